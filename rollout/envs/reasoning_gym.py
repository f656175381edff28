"""``reasoning_gym``: reasoning-gym's procedural datasets (PyPI ``reasoning-gym``) as a one-turn environment.

    env: {name: reasoning_gym, options: {dataset: chain_sum, min_terms: 2, max_terms: 3}}
    env: {name: reasoning_gym, options: {datasets: {chain_sum: {weight: 2, config: {max_terms: 3}},
                                                    basic_arithmetic: {weight: 1}}}}

Tasks are reasoning-gym's own: ``reasoning_gym.create_dataset(dataset, size=tasks.count, seed=tasks.seed,
**config)`` (several datasets: its ``composite`` dataset, each with a weight). The prompt is a system message
(reasoning-gym's ``default`` system prompt unless ``system_prompt`` names another of ``SYSTEM_PROMPTS`` or gives
the text; null: none) and the entry's question. The answer is the text inside the last ``<answer>...</answer>``
of the final assistant content (``reasoning_gym.utils.extract_answer``), scored by the entry's own dataset's
``score_answer`` (no answer: what it gives ``None``, usually 0), the dataset built with the run's config (some score
against it). Each task's metadata holds the whole dataset entry (question, answer, metadata) and that config, so
the shards' ``task`` column is enough to score a row again (:func:`score_entry`).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import pydantic

from tito_renderers.types import ParsedResponse

from .base import EnvError, Environment, EnvOptions, Message, RolloutState, Score, StepResult, Task, last_assistant

ENTRY = "reasoning_gym"  # the key of Task.metadata that holds the dataset entry
CONFIG = "reasoning_gym_config"  # ... and the config of the dataset that made it


class DatasetWeight(EnvOptions):
    weight: float = pydantic.Field(1.0, gt=0, description="relative share of the tasks")
    config: dict[str, Any] = pydantic.Field(default_factory=dict, description="that dataset's config")


class ReasoningGymOptions(EnvOptions):
    dataset: str | None = pydantic.Field(None, description="one reasoning-gym dataset name (`tito envs` options not "
                                                           "listed here are that dataset's config)")
    datasets: dict[str, DatasetWeight] | None = pydantic.Field(
        None, description="several datasets, name -> {weight, config}: reasoning-gym's composite dataset")
    system_prompt: str | None = pydantic.Field(
        "default", description="a name in reasoning_gym.utils.SYSTEM_PROMPTS, or the prompt's text; null: none")
    config: dict[str, Any] = pydantic.Field(default_factory=dict, description="the dataset's config (also given as "
                                                                               "further options)")


def _reasoning_gym():
    try:
        import reasoning_gym
        import reasoning_gym.utils
    except ImportError as e:
        raise EnvError(f"environment 'reasoning_gym' needs the reasoning-gym package ({e}); pip install "
                       "reasoning-gym") from None
    return reasoning_gym


@functools.cache
def score_fn(dataset: str) -> Callable[[str | None, dict], float]:
    """reasoning-gym's scorer of the entries of ``dataset`` under its default config."""
    return _reasoning_gym().get_score_answer_fn(dataset)


def score_entry(answer: str | None, entry: dict[str, Any], config: dict[str, Any] | None = None) -> float:
    """What reasoning-gym scores ``answer`` for ``entry`` (a row's ``task`` column holds both the entry and, in
    ``metadata.reasoning_gym_config``, the config its dataset was made with: some datasets score against their
    config, e.g. puzzle24's number range, time_intervals' date range)."""
    name = entry["metadata"]["source_dataset"]
    if not config:
        return float(score_fn(name)(answer, entry))
    scorer = _reasoning_gym().create_dataset(name, size=1, seed=0, **config)
    return float(scorer.score_answer(answer, entry))


class ReasoningGymEnv(Environment):
    """reasoning-gym's datasets: one turn, the answer inside ``<answer>...</answer>``, scored by the dataset.

    Score: ``reward`` is the dataset's ``score_answer`` (0..1; partial credit where the dataset gives it),
    ``answered`` 1.0 when the final content has an ``<answer>`` tag. Options other than those listed are the
    dataset's config (reasoning-gym's ``<Name>Config`` fields), checked when the environment is built.
    """

    name = "reasoning_gym"
    Options = ReasoningGymOptions
    options: ReasoningGymOptions

    def __init__(self, options: ReasoningGymOptions | None = None, **kwargs: Any) -> None:
        if options is None:  # options beside the known ones are the dataset's config
            known = set(ReasoningGymOptions.model_fields)
            config = {k: v for k, v in kwargs.items() if k not in known}
            kwargs = {k: v for k, v in kwargs.items() if k in known}
            if config:
                kwargs["config"] = {**kwargs.get("config", {}), **config}
        super().__init__(options, **kwargs)
        o = self.options
        rg = _reasoning_gym()
        if (o.dataset is None) == (o.datasets is None):
            raise EnvError("environment 'reasoning_gym': give options.dataset (one name) or options.datasets "
                           "(name -> {weight, config}), not both nor neither")
        if o.datasets is not None and o.config:
            raise EnvError("environment 'reasoning_gym': with options.datasets each dataset's config goes in its "
                           f"own entry, not at the top ({', '.join(sorted(o.config))})")
        # each dataset's config, by name: what its tasks record and its scorer is built with
        self._configs = {o.dataset: dict(o.config)} if o.dataset is not None else \
            {name: dict(w.config) for name, w in o.datasets.items()}
        for name in self._configs:
            if name not in rg.factory.DATASETS:
                near = difflib.get_close_matches(name, rg.factory.DATASETS, n=3)
                hint = f"; did you mean {', '.join(near)}?" if near else " (reasoning_gym.factory.DATASETS lists them)"
                raise EnvError(f"environment 'reasoning_gym': unknown dataset {name!r}{hint}")
        if o.system_prompt is not None and not o.system_prompt.strip():
            raise EnvError("environment 'reasoning_gym': options.system_prompt is blank (null for no system prompt)")
        self._system = rg.utils.SYSTEM_PROMPTS.get(o.system_prompt, o.system_prompt) if o.system_prompt else None
        # a config reasoning-gym refuses is an error now, before any engine starts; the instance scores answers,
        # since some datasets score against their config (composite: each part under its own config)
        self._scorer = self._dataset(1, 0)

    def _dataset(self, size: int, seed: int):
        rg = _reasoning_gym()
        o = self.options
        try:
            if o.dataset is not None:
                return rg.create_dataset(o.dataset, size=size, seed=seed, **self._configs[o.dataset])
            from reasoning_gym.composite import DatasetSpec

            specs = [DatasetSpec(name, w.weight, self._configs[name]) for name, w in o.datasets.items()]
            return rg.create_dataset("composite", size=size, seed=seed, datasets=specs)
        except (TypeError, ValueError, AssertionError, KeyError) as e:
            what = o.dataset or ", ".join(o.datasets)
            raise EnvError(f"environment 'reasoning_gym': dataset {what} refused its config: "
                           f"{type(e).__name__}: {e}") from None

    def generate_tasks(self, n: int, seed: int) -> list[Task]:
        tasks = []
        for i, entry in enumerate(self._dataset(n, seed)):
            entry = dict(entry)
            source = entry.get("metadata", {}).get("source_dataset", self.options.dataset)
            messages = ([{"role": "system", "content": self._system}] if self._system else []) + [
                {"role": "user", "content": entry["question"]}]
            tasks.append(Task(task_id=f"{source}-s{seed}-{i}", messages=messages,
                              answer=None if entry.get("answer") is None else str(entry["answer"]),
                              metadata={ENTRY: entry, CONFIG: dict(self._configs.get(source, {}))}))
        return tasks

    def reset(self, task: Task) -> RolloutState:
        entry = task.metadata.get(ENTRY)
        if not isinstance(entry, dict) or not isinstance(entry.get("metadata"), dict) \
                or "source_dataset" not in entry["metadata"]:
            raise EnvError(f"environment 'reasoning_gym': task {task.task_id!r} has no reasoning-gym entry in "
                           f"metadata[{ENTRY!r}] (question, answer, metadata.source_dataset): a task from a file "
                           "must carry the dataset entry it was made from")
        return RolloutState(task=task)

    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        self._begin_step(state, parsed)
        state.done = True
        return StepResult(new_messages=[], done=True)

    def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        from reasoning_gym.utils import extract_answer

        last = last_assistant(trajectory)
        content = last.get("content") if last else None
        answer = extract_answer(content, tag_name="answer") if isinstance(content, str) else None
        entry = state.task.metadata[ENTRY]
        if entry["metadata"]["source_dataset"] in self._configs:
            reward = float(self._scorer.score_answer(answer, entry))
        else:  # a task from a file, of a dataset this env was not configured with
            reward = score_entry(answer, entry, state.task.metadata.get(CONFIG))
        return Score(reward=reward, components={"answered": float(answer is not None)})
