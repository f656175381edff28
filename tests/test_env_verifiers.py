"""verifiers environments in tito (``env.name: verifiers``, issue 41 item 4): verifiers 0.4.0's own machinery —
``load_environment``, its ``null`` harness program (run with uv), its ``EvalClient`` relaying each streamed call —
plays a multi-turn taskset written for these tests (tests/verifiers_plugins/tito_vf_colours: three model calls an
episode, the env's own user turns between them), while tito's embedded engine (SmolLM2-135M) samples every turn.

Shown: each row's prompt tokens at every user turn are transformers' apply_chat_template of the conversation so
far (the turns were bridged append-only, no breaks); the user turns are the verifiers env's; the reward is the
env's, recomputed from the row; an episode whose env raises is one ``env_error`` row with verifiers' error; in
follow mode the tokens of a batch sampled after an update carry the new version. Bad options are one EnvError
when the env is built."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.placement import RayPlacement  # noqa: E402
from rollout.cli.run import run  # noqa: E402
from rollout.config import FollowConfig, RunConfig, load_config  # noqa: E402
from rollout.data import layout, load_samples  # noqa: E402
from rollout.data.readers import shard_files  # noqa: E402
from rollout.data.shards import read_table  # noqa: E402
from rollout.envs import EnvError, make_env  # noqa: E402
from rollout.envs.verifiers_adapter.env import _past  # noqa: E402
from rollout.follow.publish import publish_weights  # noqa: E402

from ._support import (  # noqa: E402
    EMBEDDED_ENGINE,
    REPO,
    SMOLLM2,
    client_venv,
    init_local_ray,
    reference,
    reference_ids,
    smollm2_gguf,
)
from .test_clients_rl import VERIFIERS_REQUIREMENTS  # noqa: E402
from .test_follow import Harness, _config_of, _perturbed, base_state, model_path  # noqa: E402, F401 - fixtures

PLUGINS = REPO / "tests" / "verifiers_plugins"
FOLLOW_UPS = ["Another one.", "One more."]
BROKEN = "fruit"


@pytest.fixture(scope="module")
def vf_python(tmp_path_factory):
    """verifiers 0.4.0's cached venv (the one test_clients_rl uses), with the test taskset importable."""
    root = client_venv("verifiers", VERIFIERS_REQUIREMENTS)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGINS), old) if p)  # the worker inherits it
    yield str(root / "bin" / "python")
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def _options(python: str, **taskset) -> dict:
    return {"python": python, "config": {"taskset": {"id": "tito-vf-colours", **taskset},
                                         "player": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}}}


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    init_local_ray(tmp_path_factory, "tito-test-env-verifiers")
    yield
    ray.shutdown()


def _check_tokens_are_the_templates(row: dict) -> None:
    """The row's tokens before each assistant turn are transformers' render of the conversation so far (with the
    generation prompt): the first prompt id for id, each later one as text, since the history holds the tokens
    the model sampled, which need not be how the tokenizer would split the same text. Only the model's tokens
    are trained on, each attributed to an assistant message; no turn broke."""
    hf = reference(SMOLLM2)
    messages, ids = row["messages"], row["token_ids"]
    starts = {}
    for position, (mask, index) in enumerate(zip(row["loss_mask"], row["message_index"])):
        assert not mask or messages[index]["role"] == "assistant"
        if mask:
            starts.setdefault(index, position)
    assert sorted(starts) == [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    first = min(starts)
    assert ids[:starts[first]] == reference_ids(SMOLLM2, messages[:first], add_generation_prompt=True)
    for index, start in starts.items():
        text = hf.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        assert hf.decode(ids[:start]) == text, (index, messages)


@pytest.mark.slow
def test_a_verifiers_multi_turn_episode_runs_token_exact_with_its_reward(vf_python, tmp_path, local_ray):
    options = json.dumps(_options(vf_python, broken_topic=BROKEN))
    cfg = load_config(None, [f"model={smollm2_gguf()}", *EMBEDDED_ENGINE, "renderer.num_cpus=0", "env.name=verifiers",
                             f"env.options={options}", "tasks.count=3", "tasks.seed=0", "group_size=2",
                             "max_turns=4", "max_tokens_per_turn=64", "max_tokens_per_rollout=256",
                             "sampling.temperature=0.8", "sampling.seed=3", f"output.dir={tmp_path / 'out'}",
                             "output.flush_interval_s=0", "env.max_error_rate=1.0"])
    summary = run(cfg, RayPlacement(), progress=False)
    rows = [r for f in shard_files(tmp_path / "out") for r in read_table(f).to_pylist()]
    for r in rows:
        r["messages"] = json.loads(r["messages"]) if isinstance(r["messages"], str) else r["messages"]
    assert summary["rollouts"] == 6 and len({r["rollout_id"] for r in rows}) == 6
    broken = [r for r in rows if r["task_id"] == f"name-a-{BROKEN}"]
    healthy = [r for r in rows if r["task_id"] != f"name-a-{BROKEN}"]
    assert len(broken) == 2 and len(healthy) == 4, [r["task_id"] for r in rows]
    for r in broken:  # the env raised in verifiers after the first reply: one env_error row, the run went on
        assert r["finish_reason"] == "env_error" and "the game broke" in r["error"], r["error"]
    multi_turn = 0
    for r in healthy:
        assert r["error"] is None and r["breaks"] in (None, "[]", []), r
        messages = r["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * (len(messages) // 2)
        users = [m["content"] for m in messages if m["role"] == "user"]
        assert users[0].startswith("Name a ") and users[1:] == FOLLOW_UPS[:len(users) - 1]  # the env's user turns
        replies = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert r["reward"] == pytest.approx(len(set(replies)) / 3)  # the env's reward, recomputed from the row
        components = json.loads(r["reward_components"])
        assert components["metric/replies"] == len(replies)
        multi_turn += len(replies) >= 2
        _check_tokens_are_the_templates(r)
        task = json.loads(r["task"])
        assert task["metadata"]["verifiers"]["env_id"] == "tito-vf-colours"
        assert task["metadata"]["verifiers"]["data"]["prompt"] == users[0]
    assert multi_turn >= 1, "no episode made a second model call"


def test_verifiers_options_it_cannot_run_are_one_error_when_the_env_is_built(vf_python):
    with pytest.raises(EnvError, match="config.taskset.id must name the verifiers taskset"):
        make_env("verifiers", config={"player": {}})
    with pytest.raises(EnvError, match=f"{sys.executable} cannot import verifiers"):
        make_env("verifiers", **_options(sys.executable))
    with pytest.raises(EnvError, match="loading the env .'no-such-taskset'. failed: ModuleNotFoundError: taskset "
                                       "'no-such-taskset' not found"):
        make_env("verifiers", **{**_options(vf_python), "config": {"taskset": {"id": "no-such-taskset"}}})
    with pytest.raises(EnvError, match="is not a file"):
        make_env("verifiers", **_options("/no/such/python"))


def test_tito_run_with_a_taskset_verifiers_cannot_load_stops_in_one_line_before_ray(vf_python, tmp_path):
    options = json.dumps({**_options(vf_python), "config": {"taskset": {"id": "no-such-taskset"}}})
    (tmp_path / "config.yaml").write_text(f"model: {smollm2_gguf()}\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "actors.cli", "run", str(tmp_path / "config.yaml"), "--set",
                           "env.name=verifiers", "--set", f"env.options={options}", "--set",
                           f"output.dir={tmp_path / 'out'}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "environment 'verifiers': loading the env ('no-such-taskset') failed" in line, line
    assert not list(tmp_path.glob("session_*")) and not (tmp_path / "out").exists()  # nothing started, nothing left


def test_a_harness_that_rewrites_the_conversation_is_refused_with_the_message_named():
    shown = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]
    assert _past(shown, [*shown, {"role": "user", "content": "Another one."}]) == [
        {"role": "user", "content": "Another one."}]
    # the harness echoes tito's assistant message in its own wire form: only its role is compared
    assert _past(shown, [shown[0], {"role": "assistant", "content": [{"type": "text", "text": "Red."}]},
                         {"role": "user", "content": "x"}])
    with pytest.raises(EnvError, match="rewrote message 0 .user.: its content changed"):
        _past(shown, [{"role": "user", "content": "Summary: ..."}, shown[1], {"role": "user", "content": "x"}])
    with pytest.raises(EnvError, match="dropped or replaced history"):
        _past(shown, [{"role": "user", "content": "compacted"}])
    with pytest.raises(EnvError, match="added an assistant message tito did not sample"):
        _past(shown, [*shown, {"role": "assistant", "content": "forged"}])


@pytest.mark.slow
def test_follow_mode_plays_verifiers_episodes_and_a_batch_after_an_update_carries_its_version(
        vf_python, tmp_path, model_path, base_state):  # noqa: F811
    """``--follow``'s service in this process (test_follow's Harness: the embedded engine, a renderer service, the
    driver) with the verifiers env; a stand-in trainer publishes version 1 once batch 1 is sealed, and with
    ``max_off_policy_steps`` 0 batch 2 waits for it: every sampled token of batch 2 is version 1's."""
    model, base = base_state
    options = _options(vf_python)
    cfg = RunConfig(env={"name": "verifiers", "options": options}, group_size=2, max_turns=3,
                    max_tokens_per_turn=64, max_tokens_per_rollout=192,
                    sampling={"temperature": 1.0, "seed": 7}, max_concurrent_rollouts=2,
                    follow=FollowConfig(groups_per_step=1, poll_interval_s=0.05, max_steps=2,
                                        max_off_policy_steps=0))
    tasks = make_env("verifiers", **options).generate_tasks(2, 0)
    h = Harness(cfg, tmp_path, model_path, tasks)

    async def main() -> int:
        service = asyncio.create_task(h.follow.run())
        while h.follow.sealed < 1:
            await asyncio.sleep(0.05)
        publish_weights(tmp_path, 1, _perturbed(base, 1.2), config=_config_of(model))
        return await asyncio.wait_for(service, 600)

    assert asyncio.run(main()) == 2
    h.service.close()
    for step, version in ((1, 0), (2, 1)):
        samples = load_samples(layout.step_dir(tmp_path, step))
        assert len(samples) >= 2
        for s in samples:
            sampled = {int(v) for v, m in zip(s.weight_versions, s.loss_mask) if m}
            assert sampled == {version}, (step, sampled)
    turns = [len({int(t) for t, m in zip(s.turn_index, s.loss_mask) if m}) for k in (1, 2)
             for s in load_samples(layout.step_dir(tmp_path, k))]
    assert max(turns) >= 2, turns  # the env's user turns came back through the follow service too
