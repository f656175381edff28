"""Environments people already have (issue 41): plug-in classes by ``package.module:Class`` and by
``tito.environments`` entry points of an installed distribution (a real dist-info on sys.path, found by
importlib.metadata as pip's would be), ``tito envs``, reasoning-gym's datasets scored by reasoning-gym itself,
and the shards' ``task`` column, from which a row's reward is recomputed without the run.

The end-to-end runs use a real local Ray with replay engines: recorded completions for the exact prompt ids
transformers' ``apply_chat_template`` gives (so what is scored is known), or synthetic ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray  # noqa: E402

from actors.placement import RayPlacement  # noqa: E402
from rollout.cli.main import main as tito  # noqa: E402
from rollout.cli.run import run  # noqa: E402
from rollout.config import load_config  # noqa: E402
from rollout.data.readers import shard_files  # noqa: E402
from rollout.data.shards import read_table  # noqa: E402
from rollout.envs import EnvError, make_env  # noqa: E402
from rollout.envs.registry import available_envs, resolve_env  # noqa: E402

from ._support import REPO, init_local_ray, reference, reference_ids, tokenizer_dir  # noqa: E402

RAY = RayPlacement()
QWEN = "qwen2.5-7b-instruct"
VOCAB = 151665

PLUGIN = '''
import pydantic
from rollout.envs import Environment, EnvOptions, Score, StepResult


class Options(EnvOptions):
    bonus: float = pydantic.Field(0.25, description="the reward of every rollout")


class ConstantEnv(Environment):
    """Rewards every rollout with ``bonus``; one turn."""

    name = "constant"
    Options = Options

    async def step(self, state, parsed):
        self._begin_step(state, parsed)
        return StepResult(new_messages=[], done=True)

    def score(self, state, trajectory):
        return Score(reward=self.options.bonus, components={"turns": float(state.turns)})

    def generate_tasks(self, n, seed):
        from rollout.envs import Task
        return [Task(task_id=f"c{seed}-{i}", messages=[{"role": "user", "content": f"Say {i}."}],
                     metadata={"i": i, "tags": {"b", "a"}}) for i in range(n)]


class SyncStep(ConstantEnv):
    name = "sync_step"

    def step(self, state, parsed):
        return StepResult(new_messages=[], done=True)


class NoScore:
    name = "no_score"
    tools = None

    def reset(self, task): ...
    async def step(self, state, parsed): ...
    def generate_tasks(self, n, seed): ...


not_a_class = ConstantEnv()
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """A distribution ``tito-test-envs`` on sys.path: module ``tito_test_envs`` and a dist-info with entry points,
    one of them broken (its module raises on import)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "tito_test_envs.py").write_text(PLUGIN)
    (site / "tito_test_broken.py").write_text("raise RuntimeError('the plug-in cannot start here')\n")
    info = site / "tito_test_envs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tito-test-envs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[tito.environments]\nconstant = tito_test_envs:ConstantEnv\nbroken = tito_test_broken:Env\n"
        "arithmetic = tito_test_envs:ConstantEnv\n")
    monkeypatch.syspath_prepend(str(site))
    yield site
    for name in ("tito_test_envs", "tito_test_broken"):
        sys.modules.pop(name, None)


def test_a_class_by_module_path_and_by_entry_point_is_the_same_environment(plugins):
    by_path = make_env("tito_test_envs:ConstantEnv", bonus=0.5)
    by_entry = make_env("constant", bonus=0.5)
    assert type(by_path) is type(by_entry) and by_entry.options.bonus == 0.5
    assert resolve_env("constant").__module__ == "tito_test_envs"
    with pytest.raises(EnvError, match=r"environment 'constant': unknown option\(s\) 'bonsu' \(options: bonus\)"):
        make_env("constant", bonsu=1)


@pytest.mark.parametrize("name, message", [
    ("no_such_env", r"unknown environment 'no_such_env' \(known: arithmetic, calculator, python, reasoning_gym, "
                    r"try_again, verifiers, broken, constant; or 'package.module:Class'"),
    ("tito_test_nothing:Env", r"importing 'tito_test_nothing' failed: ModuleNotFoundError"),
    ("tito_test_broken:Env", r"importing 'tito_test_broken' failed: RuntimeError: the plug-in cannot start here"),
    ("broken", r"environment 'broken' \(entry point 'tito_test_broken:Env' in tito.environments\): loading it failed: "
               r"RuntimeError: the plug-in cannot start here"),
    ("tito_test_envs:Missing", r"module 'tito_test_envs' has no 'Missing'"),
    ("tito_test_envs", r"unknown environment"),
    ("tito_test_envs:not_a_class", r"is a ConstantEnv, not a class"),
    ("tito_test_envs:SyncStep", r"does not keep the environment protocol \(rollout/envs/base.py\): step\(\) is not "
                                r"`async def`"),
    ("tito_test_envs:NoScore", r"does not keep the environment protocol .*: no score\(\)"),
    ("rollout.envs.base:Environment", r"step\(\) is abstract .*; score\(\) is abstract .*; generate_tasks\(\) is "
                                      r"abstract"),
])
def test_a_name_that_is_not_an_environment_is_one_error_naming_why(plugins, name, message):
    with pytest.raises(EnvError, match=message):
        make_env(name)


def test_tito_envs_lists_built_ins_and_entry_points_with_their_options(plugins, capsys):
    assert tito(["envs"]) == 1  # the broken entry point is listed with its error: not a clean bill
    out = capsys.readouterr().out
    assert "constant  (entry point tito_test_envs:ConstantEnv (tito-test-envs))" in out
    assert "    options.bonus: default 0.25 - the reward of every rollout" in out
    assert "broken  (entry point tito_test_broken:Env (tito-test-envs))\n    cannot load: " in out
    # an entry point under a built-in's name is shadowed: listed with why, and the built-in is what the name runs
    assert "arithmetic  (entry point tito_test_envs:ConstantEnv (tito-test-envs))\n    cannot load: the name " \
        "'arithmetic' is the built-in ArithmeticEnv's; name it as 'tito_test_envs:ConstantEnv' instead" in out
    assert resolve_env("arithmetic").__name__ == "ArithmeticEnv"
    assert "reasoning_gym  (built-in)" in out and "options.dataset: default None" in out
    assert tito(["envs", "constant", "--json"]) == 0
    (listed,) = json.loads(capsys.readouterr().out)
    assert listed["options"]["bonus"] == {"default": 0.25, "required": False, "description": "the reward of every rollout"}
    assert tito(["envs", "tito_test_envs:SyncStep"]) == 1
    assert "step() is not `async def`" in capsys.readouterr().err
    names = [e["name"] for e in available_envs()]
    assert names[:5] == ["arithmetic", "calculator", "python", "reasoning_gym", "try_again"]


def _settings(tmp_path, **over) -> list[str]:
    sets = [f"model={tokenizer_dir(QWEN)}", "engine.backend=replay", "engine.num_cpus=0",
            f"engine.options={{synthetic: true, vocab_size: {VOCAB}, max_model_len: 4096}}", "renderer.num_cpus=0",
            "tasks.count=3", "group_size=2", "max_turns=1", "max_tokens_per_turn=8", "max_tokens_per_rollout=8",
            f"output.dir={tmp_path / 'out'}", "output.flush_interval_s=0"]
    return sets + [f"{k}={v}" for k, v in over.items()]


def test_a_plugin_that_breaks_the_protocol_stops_tito_run_before_any_engine_starts(plugins, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=f"{plugins}{os.pathsep}{REPO}", RAY_TMPDIR=str(tmp_path))
    sets = [a for s in _settings(tmp_path, **{"env.name": "tito_test_envs:SyncStep"}) for a in ("--set", s)]
    (tmp_path / "config.yaml").write_text(f"model: {tokenizer_dir(QWEN)}\n")
    proc = subprocess.run([sys.executable, "-m", "actors.cli", "run", str(tmp_path / "config.yaml"), *sets], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "step() is not `async def`" in line, line
    assert not list(tmp_path.glob("session_*")), "a Ray session was started"  # nothing started before the check


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    init_local_ray(tmp_path_factory, "tito-test-env-plugins")
    yield
    ray.shutdown()


def _rows(out) -> list[dict]:
    return [r for f in shard_files(out) for r in read_table(f).to_pylist()]


def test_an_entry_point_environment_runs_and_every_row_carries_its_task(plugins, tmp_path, local_ray):
    cfg = load_config(None, _settings(tmp_path, **{"env.name": "constant", "env.options": "{bonus: 0.75}"}))
    summary = run(cfg, RAY, progress=False)
    assert summary["rollouts"] == 6 and summary["errors"] == 0
    rows = _rows(tmp_path / "out")
    assert len(rows) == 6 and {r["reward"] for r in rows} == {0.75}
    tasks = {t.task_id: t for t in make_env("constant").generate_tasks(3, 0)}
    for r in rows:
        task = json.loads(r["task"])
        want = tasks[r["task_id"]]
        # the record is the task as the environment gave it; a set in its metadata is written as a sorted list
        assert task == {"task_id": want.task_id, "messages": want.messages, "answer": None,
                        "metadata": {"i": want.metadata["i"], "tags": ["a", "b"]}}
        # synthetic completions run to max_tokens: the turn is cut ("length") and never stepped
        assert r["finish_reason"] == "length" and json.loads(r["reward_components"]) == {"turns": 0.0}


# ---- reasoning-gym ------------------------------------------------------------------------------------------


def test_reasoning_gym_tasks_are_the_datasets_own_with_its_system_prompt():
    import reasoning_gym
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = make_env("reasoning_gym", dataset="chain_sum", min_terms=2, max_terms=3)
    tasks = env.generate_tasks(5, 11)
    expected = reasoning_gym.create_dataset("chain_sum", size=5, seed=11, min_terms=2, max_terms=3)
    assert [t.messages for t in tasks] == [
        [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": e["question"]}]
        for e in expected]
    assert [t.answer for t in tasks] == [e["answer"] for e in expected]
    assert len({t.task_id for t in tasks}) == 5
    # another system prompt by name, by text, or none
    assert make_env("reasoning_gym", dataset="chain_sum", system_prompt="simple").generate_tasks(1, 0)[0].messages[0] \
        == {"role": "system", "content": SYSTEM_PROMPTS["simple"]}
    assert make_env("reasoning_gym", dataset="chain_sum", system_prompt="Be brief.").generate_tasks(1, 0)[0] \
        .messages[0]["content"] == "Be brief."
    assert [m["role"] for m in make_env("reasoning_gym", dataset="chain_sum", system_prompt=None)
            .generate_tasks(1, 0)[0].messages] == ["user"]


def test_reasoning_gym_composite_draws_from_each_dataset_by_weight():
    import reasoning_gym
    from reasoning_gym.composite import DatasetSpec

    env = make_env("reasoning_gym", datasets={"chain_sum": {"weight": 3, "config": {"max_terms": 3}},
                                              "basic_arithmetic": {"weight": 1}})
    tasks = env.generate_tasks(40, 2)
    expected = reasoning_gym.create_dataset("composite", size=40, seed=2, datasets=[
        DatasetSpec("chain_sum", 3, {"max_terms": 3}), DatasetSpec("basic_arithmetic", 1, {})])
    assert [t.messages[-1]["content"] for t in tasks] == [e["question"] for e in expected]
    sources = [t.metadata["reasoning_gym"]["metadata"]["source_dataset"] for t in tasks]
    assert set(sources) == {"chain_sum", "basic_arithmetic"} and sources.count("chain_sum") > 20


@pytest.mark.parametrize("options, message", [
    ({"dataset": "chain_summ"}, r"unknown dataset 'chain_summ'; did you mean chain_sum"),
    ({"dataset": "chain_sum", "max_termz": 3}, r"dataset chain_sum refused its config: TypeError: .*'max_termz'"),
    ({"dataset": "chain_sum", "min_terms": 5, "max_terms": 2}, r"refused its config: AssertionError: max_terms"),
    ({}, r"give options.dataset \(one name\) or options.datasets"),
    ({"datasets": {"chain_sum": {"weight": 0}}}, r"option 'datasets.chain_sum.weight': Input should be greater than 0"),
    ({"datasets": {"chain_sum": {}}, "max_terms": 3}, r"each dataset's config goes in its own entry"),
])
def test_reasoning_gym_options_it_refuses_are_named_when_the_env_is_built(options, message):
    with pytest.raises(EnvError, match=message):
        make_env("reasoning_gym", **options)


def test_reasoning_gym_run_scores_the_last_answer_tag_as_the_dataset_does_and_rows_rescore_alone(tmp_path, local_ray):
    """Recorded completions for the exact prompts: right, wrong, without a tag, two tags (the last counts). Each
    row's reward equals reasoning-gym's score_answer of the dataset, recomputed from the row's task column and
    messages alone."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    options = {"dataset": "basic_arithmetic", "max_terms": 3}
    tasks = make_env("reasoning_gym", **options).generate_tasks(4, 5)
    texts = [f"Easy. <answer>{tasks[0].answer}</answer>", "<answer>12345678</answer>",
             f"It is {tasks[2].answer}.", f"<answer>0</answer> no wait: <answer>{tasks[3].answer}</answer>"]
    tok = reference(QWEN)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    records = [{"prompt_ids": reference_ids(QWEN, t.messages, add_generation_prompt=True),
                "completion_ids": tok(text, add_special_tokens=False)["input_ids"] + [end], "stop_token_id": end}
               for t, text in zip(tasks, texts)]
    (tmp_path / "opts.json").write_text(json.dumps(options))
    cfg = load_config(None, [f"model={tokenizer_dir(QWEN)}", "engine.backend=replay", "engine.num_cpus=0",
                             f"engine.options={json.dumps({'records': records, 'vocab_size': VOCAB})}",
                             "renderer.num_cpus=0", "env.name=reasoning_gym", f"env.options={json.dumps(options)}",
                             "tasks.count=4", "tasks.seed=5", "group_size=2", "max_turns=1",
                             "max_tokens_per_turn=64", "max_tokens_per_rollout=64", f"output.dir={tmp_path / 'out'}"])
    summary = run(cfg, RAY, progress=False)
    assert summary["rollouts"] == 8 and summary["errors"] == 0, summary
    rows = _rows(tmp_path / "out")
    by_task = {}
    for r in rows:
        task = json.loads(r["task"])
        entry = task["metadata"]["reasoning_gym"]
        final = json.loads(r["messages"])[-1]
        assert final["role"] == "assistant"
        assert task["metadata"]["reasoning_gym_config"] == {"max_terms": 3}
        rescored = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0, max_terms=3).score_answer(
            extract_answer(final["content"]), entry)
        assert r["reward"] == rescored
        by_task[r["task_id"]] = r["reward"]
    assert [by_task[t.task_id] for t in tasks] == [1.0, 0.0, 0.0, 1.0]
    dataset = reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=5, max_terms=3)
    assert [dataset.score_answer(extract_answer(x), e) for x, e in zip(texts, dataset)] == [1.0, 0.0, 0.0, 1.0]


def test_reasoning_gym_scores_under_the_datasets_own_config_also_from_the_row_alone():
    """puzzle24 checks the numbers used against its configured range: under min_value 6, "1*2*3*4" is not a
    solution (reasoning-gym gives 0.01), while a scorer with the default config (min_value 1) would give 1.0."""
    import reasoning_gym

    from rollout.envs.reasoning_gym import score_entry

    options = {"dataset": "puzzle24", "min_value": 6, "max_value": 10}
    env = make_env("reasoning_gym", **options)
    tasks = env.generate_tasks(6, 3)
    dataset = reasoning_gym.create_dataset("puzzle24", size=6, seed=3, min_value=6, max_value=10)
    for task, entry in zip(tasks, dataset):
        for answer in (entry["answer"], "1*2*3*4", "24", None):
            content = "no tag" if answer is None else f"<answer>{answer}</answer>"
            got = env.score(env.reset(task), [*task.messages, {"role": "assistant", "content": content}]).reward
            assert got == dataset.score_answer(answer, entry)
            # from the task column alone: the entry and the config it was made with
            record = json.loads(task.record())["metadata"]
            assert score_entry(answer, record["reasoning_gym"], record["reasoning_gym_config"]) == got
    assert dataset.score_answer("1*2*3*4", dataset[0]) < 1.0 == reasoning_gym.get_score_answer_fn("puzzle24")(
        "1*2*3*4", dataset[0])
