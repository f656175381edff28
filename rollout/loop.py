"""The multi-turn rollout loop: render -> generate -> parse -> environment step -> bridge -> ...

``RolloutDriver`` runs G rollouts per task against engines and renderer services (local objects
or Ray actors, through the typed handles of rollout/handles.py), computes group advantages, and hands each finished
rollout's metadata to the renderer that holds its segments, which writes the shard rows.

A rollout stops when the environment says done, when the assistant's turn leaves nothing to answer
(no tool call and no feedback), at ``max_turns``, when the engine hits ``max_tokens`` (finish
"length": the turn is truncated), when the next turn would not fit the model's context, or when the
rollout's token budget is spent. A rollout that raises or times out is recorded with its error and
the run goes on. An engine that is lost mid-rollout (its actor died, or it hung) is dropped from routing and
the turn it was sampling is sent again, token-in, to a live engine (the lost one returned nothing of it; the
rollout's earlier turns stay), so every task x group member appears exactly once. The lost engine is restarted
and rejoins (rollout/engines/healer.py).

Weight updates mid-run (``tito run --follow``, rollout/follow/): :meth:`RolloutDriver.hold_for_update` closes
a gate that new engine requests wait at and, in ``abort_resume`` mode, aborts the requests in flight. An aborted
turn keeps the tokens and logprobs it sampled, stamped with the version that sampled them, and goes on after
:meth:`RolloutDriver.release` as prompt + partial completion under the new weights: token-in makes the
continuation exact (the same context, the rest of the budget), so nothing sampled is thrown away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Literal, TypeVar

import msgspec

from tito_renderers import Renderer

from .config import RunConfig, SamplingConfig
from .engines.healer import EngineHealer, is_actor_death
from .engines.protocol import EngineInfo, GenerateRequest, GenerateResult, SamplingParams
from .envs.base import Environment, Task
from .envs.guard import EnvFault, GuardedEnv
from .handles import BoundedRenderer, EngineHandle, RendererHandle, RendererHung
from .routing import StickyLeastLoaded
from .turns import Finished, RolloutMeta, SampledTurn, Sampling

T = TypeVar("T")


class EngineDied(RuntimeError):
    """The engine a request went to was lost before it answered: the request may be sent to another."""


def _stderr_line(line: str) -> None:
    print(f"tito: {line}", file=sys.stderr, flush=True)


class AllEnginesDied(RuntimeError):
    """No engine is left alive: nothing more can be sampled. The groups finished before are with the renderers;
    ``tito run`` writes them and stops (``summary``: the run summary it wrote, set by rollout/cli/run.py)."""

    summary: dict | None = None

    @classmethod
    def of(cls, engines: int) -> AllEnginesDied:
        """The error for a run or service whose ``engines`` engines all died."""
        return cls("the engine died" if engines == 1 else f"all {engines} engines died")


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """What a group is rolled out with: the run's environment, group size and sampling unless a caller (follow
    mode's evaluation) brings its own."""

    env: GuardedEnv
    group_size: int
    sampling: SamplingConfig


class EnvErrorRate(RuntimeError):
    """Too many rollouts ended with env_error (``env.max_error_rate``): the environment, not one rollout, is
    broken, so the run stops, keeping what was written (``summary``: set by rollout/cli/run.py)."""

    summary: dict | None = None


class RolloutOutcome(msgspec.Struct):
    rollout_id: str
    task_id: str
    group_id: str
    finish_reason: str
    reward: float = 0.0
    components: dict[str, float] = msgspec.field(default_factory=dict)
    messages: list[dict] = msgspec.field(default_factory=list)
    unsent: int | None = None  # how many of the last messages the renderer never got; None: a failed rollout
    turns: int = 0
    completion_tokens: int = 0
    error: str | None = None
    advantage: float = 0.0
    last_turn: SampledTurn | None = None  # the final completion, recorded by the renderer with the samples
    version_min: int | None = None  # the lowest and highest version that sampled any of its tokens (None: none)
    version_max: int | None = None
    withheld: str | None = None  # why its rows were not written (follow mode: too stale); its reward still counts
    lora: str | None = None  # the LoRA adapter its last turn was sampled with (None: the base model)


async def gather_settling(coros: Iterable[Awaitable[T]]) -> list[T]:
    """``asyncio.gather``, except that once every engine died the others are let end before it raises: each
    fails at once (no engine is left) or hands its finished group to a renderer, where a plain gather would
    leave it to be cut off by the run's end. Any other failure raises at once, as before (a full disk: nothing
    more can be written, so nothing more is run)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except AllEnginesDied:
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class RolloutDriver:
    def __init__(
        self,
        cfg: RunConfig,
        env: Environment,
        engines: list[EngineHandle],
        renderers: list[RendererHandle],
        engine_info: EngineInfo,
        parser: Renderer,
        on_progress: Callable[[RolloutOutcome], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.env = env
        # every env call bounded and its result checked: a fault ends one rollout (env_error), not the run
        self.guarded = GuardedEnv(env, name=cfg.env.name, timeout_s=cfg.env.timeout_s,
                                  max_message_chars=cfg.env.max_message_chars)
        self.plan = GroupPlan(self.guarded, cfg.group_size, cfg.sampling)
        self.env_errors = 0
        self.first_env_error: str | None = None
        self.engines = engines
        # every renderer call bounded: a stopped renderer actor is named (RendererHung), not waited on for ever
        self.renderers: list[RendererHandle] = [BoundedRenderer(r, i, cfg.renderer.call_timeout_s)
                                                for i, r in enumerate(renderers)]
        self.info = engine_info
        self.parser = parser  # parses completions here: same code and tokenizer as the renderer actors
        self.stop_token_ids = tuple(parser.stop_token_ids)
        self.router = StickyLeastLoaded(len(engines), cfg.engine.overload_factor)
        self.log: Callable[[str], None] = _stderr_line  # follow mode: the service's log
        e = cfg.engine
        # a lost engine: out of routing at once, its turns re-sent to the live ones, restarted and brought back
        self.healer = EngineHealer(engines, on_lost=self.router.drop_engine, on_back=self.router.revive_engine,
                                   log=lambda line: self.log(line), restarts=e.max_restarts,
                                   heartbeat_interval_s=e.heartbeat_interval_s,
                                   heartbeat_timeout_s=e.heartbeat_timeout_s, restart_timeout_s=e.restart_timeout_s)
        self.on_progress = on_progress
        self.limit = asyncio.Semaphore(cfg.max_concurrent_rollouts)
        self.finish_counts: Counter[str] = Counter()
        self.reruns = 0  # turn requests re-sent to a live engine because theirs was lost
        self.breaks = 0  # turns that could not be bridged (the renderer logs their reasons)
        # weight updates (follow mode): requests wait at the gate while it is closed; ``_in_flight`` is every
        # request at an engine (id -> engine index), ``_update_aborts`` those a weight update stopped
        self._gate = asyncio.Event()
        self._gate.set()
        self._in_flight: dict[str, int] = {}
        self._update_aborts: set[str] = set()
        # follow mode: the LoRA adapter the engines serve the policy as, once the trainer publishes adapters
        self.lora: str | None = None
        self.resumed_turns = 0  # turns a weight update stopped and that went on under the new weights
        self.resumed_by_rollout: Counter[str] = Counter()  # the same, per rollout id (follow: each batch's own)

    # ---- groups ----------------------------------------------------------------------------------

    async def run(self, tasks: list[Task]) -> list[RolloutOutcome]:
        async with self.healing():
            groups = await gather_settling(self.run_group(task, gi) for gi, task in enumerate(tasks))
        return [o for group in groups for o in group]

    @contextlib.asynccontextmanager
    async def healing(self) -> AsyncIterator[None]:
        """The engines' heartbeat runs while this is entered (rollout/engines/healer.py)."""
        watch = asyncio.ensure_future(self.healer.watch())
        try:
            yield
        finally:
            watch.cancel()
            with contextlib.suppress(BaseException):
                await watch
            await self.healer.close()

    async def run_group(self, task: Task, group_index: int, *, group_id: str | None = None,
                        out_dir: str | None = None, min_version: int | None = None,
                        plan: GroupPlan | None = None) -> list[RolloutOutcome]:
        """The group's ``group_size`` rollouts, their advantages, and their rows handed to a renderer (to
        ``out_dir`` when given). ``group_id`` names the group (default: the task id) and its rollouts
        ``<group_id>#<i>``. With ``min_version``, a rollout that sampled any token under an older version is
        withheld (``withheld`` says why; no row is written) but its reward still counts in the baseline.
        ``plan``: another environment, group size or sampling than the run's."""
        plan = plan or self.plan
        group_id = group_id or f"{task.task_id}"
        renderer = self.renderers[group_index % len(self.renderers)]
        outcomes = await gather_settling(
            self._run_with_retries(task, group_id, f"{group_id}#{k}", renderer, plan) for k in range(plan.group_size))
        self._advantages(outcomes)
        s = plan.sampling
        sampling = Sampling(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)
        record = task.record()
        items = []
        for o in outcomes:
            if min_version is not None and o.version_min is not None and o.version_min < min_version:
                o.withheld = f"stale: sampled by version {o.version_min} < {min_version}"
                await renderer.discard(o.rollout_id)
                continue
            items.append(Finished(o.rollout_id, RolloutMeta(
                task_id=o.task_id, group_id=o.group_id, finish_reason=o.finish_reason,
                # the renderer holds the conversation up to the last turn: only what it never got is sent
                messages=o.messages if o.unsent is None else None,
                unsent_messages=o.messages[len(o.messages) - o.unsent:] if o.unsent else [],
                reward=o.reward, reward_components=o.components, advantage=o.advantage, error=o.error,
                sampling=sampling, lora=o.lora, task=record,
            ), o.last_turn))
        # one call, one unit for the shard writer: a group's rows always land in the same file, so a
        # resumed run finds every group either whole or absent
        if out_dir is None:
            await renderer.finish_group(items)
        else:
            await renderer.finish_group(items, out_dir=out_dir)
        return list(outcomes)

    def _advantages(self, outcomes: list[RolloutOutcome]) -> None:
        """reward - group mean (/ group std if configured), over the rollouts that did not fail."""
        ok = [o for o in outcomes if o.error is None]
        if not ok:
            return
        mean = statistics.fmean(o.reward for o in ok)
        std = statistics.pstdev([o.reward for o in ok]) if len(ok) > 1 else 0.0
        for o in ok:
            adv = o.reward - mean
            if self.cfg.advantage.normalize_std:
                adv = adv / (std + 1e-6)
            o.advantage = adv

    async def _run_with_retries(self, task: Task, group_id: str, rollout_id: str,
                                renderer: RendererHandle, plan: GroupPlan | None = None) -> RolloutOutcome:
        """One rollout, recorded however it ends (a lost engine's turns are re-sent to a live one inside it)."""
        async with self.limit:
            await self._engine_available()
            try:
                outcome = await asyncio.wait_for(
                    self.run_rollout(task, group_id, rollout_id, renderer, plan), self.cfg.rollout_timeout_s
                )
            except TimeoutError:
                outcome = RolloutOutcome(rollout_id, task.task_id, group_id, "timeout",
                                         messages=list(task.messages),
                                         error=f"timed out after {self.cfg.rollout_timeout_s}s")
            except (AllEnginesDied, RendererHung):  # the run cannot go on: not one failed rollout
                raise
            except EnvFault as exc:  # the environment failed this rollout: its conversation so far is kept
                outcome = RolloutOutcome(rollout_id, task.task_id, group_id, "env_error",
                                         messages=getattr(exc, "messages", None) or list(task.messages),
                                         error=str(exc))
                self.env_errors += 1
                self.first_env_error = self.first_env_error or str(exc)
            except Exception as exc:  # a failed rollout is recorded; the run goes on
                outcome = RolloutOutcome(rollout_id, task.task_id, group_id, "error", messages=list(task.messages),
                                         error=f"{type(exc).__name__}: {exc}")
        self.router.forget(rollout_id)
        self.finish_counts[outcome.finish_reason] += 1
        if self.on_progress:
            self.on_progress(outcome)
        finished = sum(self.finish_counts.values())
        e = self.cfg.env
        if self.env_errors and finished >= e.error_rate_after and self.env_errors / finished > e.max_error_rate:
            raise EnvErrorRate(f"environment {e.name!r}: {self.env_errors} of {finished} rollouts ended with "
                               f"env_error (above env.max_error_rate {e.max_error_rate:g}); the first: "
                               f"{self.first_env_error}")
        return outcome

    async def _engine_available(self) -> None:
        """Return once an engine serves; while none does but one is being restarted, wait for it. None left:
        :class:`AllEnginesDied`."""
        while not self.router.alive():
            if not self.healer.any_coming_back():
                raise AllEnginesDied.of(len(self.engines))
            await self.healer.wait_changed(1.0)

    # ---- one rollout -----------------------------------------------------------------------------

    async def _generate(self, request: GenerateRequest, session: str):
        index = self.router.acquire(session)
        self._in_flight[request.request_id] = index
        sent_at = time.monotonic()
        try:
            return await self.engines[index].generate(request)
        except asyncio.CancelledError:
            # a timed-out rollout: stop the engine's work too (cancelling the wait does not reach an actor)
            with contextlib.suppress(Exception):
                await asyncio.shield(self.engines[index].abort(request.request_id))
            raise
        except Exception as exc:
            if is_actor_death(exc):
                self.healer.lost(index, f"a call saw its actor die ({type(exc).__name__})", sent_at=sent_at)
                raise EngineDied(str(exc)) from exc
            raise
        finally:
            self._in_flight.pop(request.request_id, None)
            self.router.release(index)

    # ---- weight updates (follow mode) ------------------------------------------------------------

    async def hold_for_update(self, mode: Literal["abort_resume", "drain", "keep"]) -> int:
        """Stop sending requests until :meth:`release`, and return once the engines may load new weights:
        ``abort_resume`` aborts the requests in flight (their turns go on under the new weights),
        ``drain`` waits for them to finish on the old weights, ``keep`` returns at once (the engine finishes
        them under the weights it has when each step runs; it stamps each token's version). Returns the
        number of requests aborted."""
        self._gate.clear()
        aborted = 0
        if mode == "abort_resume":
            for rid, index in list(self._in_flight.items()):
                self._update_aborts.add(rid)
                with contextlib.suppress(Exception):  # a dead engine: its rollout is re-run elsewhere
                    aborted += bool(await self.engines[index].abort(rid))
        if mode != "keep":
            # an abort that reached an engine before its request (Ray delivers them on separate queues) is
            # ignored there, so that request runs to its end: waiting for it keeps every turn on one version
            while self._in_flight:
                await asyncio.sleep(0.01)
        return aborted

    def release(self) -> None:
        """Let requests through again (after the engines loaded new weights, or gave up on them)."""
        self._gate.set()

    async def _sample_turn(self, request: GenerateRequest, session: str) -> tuple[GenerateResult, list[int] | None]:
        """One turn's completion. A turn that a weight update aborted goes on from where it stopped (prompt +
        partial completion, the rest of its token budget) once the gate opens; the pieces are joined, and the
        per-token versions returned when they differ (None: one version sampled the whole turn). A piece that an
        engine kept running through an update (``keep``) reports its own per-token versions (``token_versions``);
        the turn's ``weight_version`` is always the lowest."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        piece = 0
        while True:
            await self._gate.wait()
            req = request if piece == 0 else msgspec.structs.replace(
                request, request_id=f"{request.request_id}.{piece}", prompt_ids=[*request.prompt_ids, *ids],
                sampling=msgspec.structs.replace(
                    request.sampling, max_tokens=request.sampling.max_tokens - len(ids),
                    min_tokens=max(0, request.sampling.min_tokens - len(ids)),
                    seed=None if request.sampling.seed is None else (request.sampling.seed + piece) % (1 << 32)))
            try:
                out = await self._generate(req, session)
            except EngineDied:  # it returned nothing: the same request goes to a live engine (token-in)
                self.reruns += 1
                await self._engine_available()
                continue
            result = out.results[0]
            resumed = result.finish_reason == "abort" and req.request_id in self._update_aborts
            self._update_aborts.discard(req.request_id)
            ids.extend(result.completion_ids)
            logprobs.extend(result.logprobs or [0.0] * len(result.completion_ids))
            versions.extend(result.token_versions or [result.weight_version] * len(result.completion_ids))
            if resumed and len(ids) < request.sampling.max_tokens:
                piece += 1
                self.resumed_turns += piece == 1
                self.resumed_by_rollout[session] += piece == 1
                continue
            spans = versions if len(set(versions)) > 1 else None
            if piece == 0:  # one request; kept running through an update, the engine stamped each token
                return (result if spans is None else
                        msgspec.structs.replace(result, weight_version=min(spans), token_versions=spans)), spans
            finish = "length" if resumed else result.finish_reason  # the budget ran out exactly at the abort
            joined = msgspec.structs.replace(result, completion_ids=ids, logprobs=logprobs, finish_reason=finish,
                                             weight_version=min(versions) if versions else result.weight_version,
                                             token_versions=spans)
            return joined, spans

    def _seed(self, rollout_id: str, turn: int, base: int | None) -> int | None:
        if base is None:
            return None
        digest = hashlib.sha256(f"{base}:{rollout_id}:{turn}".encode()).digest()
        return int.from_bytes(digest[:4], "little")

    async def run_rollout(self, task: Task, group_id: str, rollout_id: str,
                          renderer: RendererHandle, plan: GroupPlan | None = None) -> RolloutOutcome:
        messages = [dict(m) for m in task.messages]
        try:
            return await self._rollout(task, group_id, rollout_id, renderer, messages, plan or self.plan)
        except EnvFault as exc:  # the conversation up to the fault goes in its row
            exc.messages = messages  # type: ignore[attr-defined]
            raise

    async def _rollout(self, task: Task, group_id: str, rollout_id: str, renderer: RendererHandle,
                       messages: list[dict], plan: GroupPlan) -> RolloutOutcome:
        cfg, env, s = self.cfg, plan.env, plan.sampling
        state = await env.reset(task)
        if state.prompt is not None:  # the environment wrote the prompt itself (rollout/envs/base.py)
            messages[:] = [dict(m) for m in state.prompt]
        tools = state.tools if state.tools is not None else env.tools
        prompt = (await renderer.begin(rollout_id, messages, tools)).ids
        budget = cfg.max_tokens_per_rollout
        finish = "max_turns"
        last_turn = None
        turns = 0
        vmin = vmax = None  # the versions that sampled its tokens
        unsent = 0  # messages the renderer never got: the environment's answer to the last turn
        lora = None
        for turn in range(cfg.max_turns):
            max_tokens = min(cfg.max_tokens_per_turn, budget)
            if max_tokens <= 0:
                finish = "token_budget"
                break
            if len(prompt) + max_tokens > self.info.max_model_len:
                finish = "context_limit"
                break
            sampling = SamplingParams(
                max_tokens=max_tokens, temperature=s.temperature, top_p=s.top_p,
                top_k=s.top_k, seed=self._seed(rollout_id, turn, s.seed), stop_token_ids=self.stop_token_ids,
            )
            request = GenerateRequest(request_id=f"{rollout_id}/{turn}", prompt_ids=prompt, sampling=sampling,
                                      session_id=rollout_id, lora=self.lora)
            result, versions = await self._sample_turn(request, rollout_id)
            turns = turn + 1
            lora = request.lora
            if result.finish_reason in ("error", "abort"):
                raise RuntimeError(f"engine finished turn {turn} with {result.finish_reason}: {result.error}")
            budget -= len(result.completion_ids)
            parsed = self.parser.parse_response(result.completion_ids, prompt, tools)
            assistant = parsed.to_message(arguments=self.parser.history_arguments)
            messages.append(assistant)
            last_turn = SampledTurn(turn, result.completion_ids, result.logprobs, result.weight_version, assistant,
                                    versions)
            if result.completion_ids:
                lo, hi = (min(versions), max(versions)) if versions else (result.weight_version,) * 2
                vmin = lo if vmin is None else min(vmin, lo)
                vmax = hi if vmax is None else max(vmax, hi)
            if result.finish_reason == "length":
                finish = "length"
                break
            step = await env.step(state, parsed)
            if step.done:
                finish = "env_done"
                break
            if not step.new_messages:
                finish = "no_tool_call"
                break
            messages.extend(step.new_messages)
            if turn + 1 < cfg.max_turns:
                nxt = await renderer.extend(rollout_id, last_turn, step.new_messages)
                self.breaks += nxt.brk is not None
                prompt = nxt.after(prompt, result.completion_ids)
                last_turn = None
            else:
                unsent = len(step.new_messages)
        score = await env.score(state, messages)
        return RolloutOutcome(
            rollout_id=rollout_id, task_id=task.task_id, group_id=group_id, finish_reason=finish,
            reward=float(score.reward), components=dict(score.components), messages=messages, unsent=unsent,
            turns=turns,
            completion_tokens=cfg.max_tokens_per_rollout - budget, last_turn=last_turn, version_min=vmin,
            version_max=vmax, lora=lora,
        )
