"""``env.name: verifiers``: a ``verifiers.v1`` environment's episodes, sampled by tito's engines token-exact.

verifiers drives its own episodes (its ``Env.run`` plays the agents, its harness program makes the model
calls), so the adapter turns it inside out. Each rollout starts one episode in a verifiers worker process
(worker.py, run by the interpreter that has verifiers) whose model endpoint is this rollout's path on a
loopback chat-completions endpoint (endpoint.py). Every model call the harness makes becomes one turn of tito's
loop:

- ``reset`` starts the episode and waits for its first call: that call's messages and tools are the rollout's
  prompt (``RolloutState.prompt``/``tools``), rendered by tito's renderer.
- ``step`` answers the waiting call with the assistant message tito parsed from the tokens it sampled, then
  waits for the next call, whose messages past the conversation so far (tool results, the env's user turns)
  are the step's new messages, bridged append-only by tito like any env's. The episode ending is ``done``.
- ``score`` is the episode's reward (the sum of its traces' rewards, each named reward and metric a component).

So the tokens, logprobs, weight versions and breaks are tito's own records, not the harness's re-rendering. A
harness that rewrites the conversation between calls (compaction, a changed system prompt) cannot be recorded
append-only: that rollout ends with ``env_error`` naming the message. Sampling settings in the harness's
requests are ignored: the run's ``sampling`` and token limits apply (the endpoint reports no prompt tokens).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pydantic

from tito_renderers.types import ParsedResponse

from ..base import EnvError, Environment, EnvOptions, Message, RolloutState, Score, StepResult, Task
from .endpoint import CallRefused, Endpoint, ModelCall, Reply

WORKER = Path(__file__).with_name("worker.py")
KEY_VAR = "TITO_VERIFIERS_KEY"
_STDERR_TAIL = 40


class VerifiersOptions(EnvOptions):
    config: dict[str, Any] = pydantic.Field(
        description="the verifiers EnvConfig, as its TOML [env] block: {taskset: {id: ...}, <role>: {harness: "
                    "{id: null}, runtime: {type: subprocess}}, ...}")
    python: str | None = pydantic.Field(
        None, description="the interpreter that has verifiers 0.4 (default: tito's own)")
    model: str = pydantic.Field("tito", description="the model name the harness sends (tito's engines sample)")
    start_timeout_s: float = pydantic.Field(
        600.0, gt=0, description="the bound on loading the env and listing its tasks")
    log: str | None = pydantic.Field(None, description="a file that gets the worker's stderr (default: its last "
                                                        f"{_STDERR_TAIL} lines, quoted in errors)")

    @pydantic.field_validator("config")
    @classmethod
    def _names_a_taskset(cls, config: dict[str, Any]) -> dict[str, Any]:
        taskset = config.get("taskset")
        if not isinstance(taskset, dict) or not isinstance(taskset.get("id"), str) or not taskset["id"]:
            raise ValueError("config.taskset.id must name the verifiers taskset (e.g. {taskset: {id: textarena}})")
        return config


class _Episode:
    """One rollout's episode: the calls its harness makes, the worker's verdict, what the harness was shown."""

    def __init__(self, key: str, calls: asyncio.Queue[ModelCall], done: asyncio.Future) -> None:
        self.key = key
        self.calls = calls
        self.done = done
        self.pending: ModelCall | None = None
        self.shown: list[Message] = []  # the conversation as the harness last sent it, plus tito's answer
        self.answered = 0
        self.refused: str | None = None

    async def next_call(self) -> ModelCall | None:
        """The harness's next call, or None when the episode ended first."""
        getter = asyncio.ensure_future(self.calls.get())
        finished, _ = await asyncio.wait({getter, self.done}, return_when=asyncio.FIRST_COMPLETED)
        if getter in finished:
            self.pending = getter.result()
            return self.pending
        getter.cancel()
        return None

    def answer(self, reply: Reply) -> None:
        assert self.pending is not None and not self.pending.reply.done()
        self.pending.reply.set_result(reply)
        self.shown.append(reply.message)
        self.answered += 1
        self.pending = None

    def refuse(self, reason: str) -> None:
        if self.pending is not None and not self.pending.reply.done():
            self.pending.reply.set_exception(CallRefused(reason))
        self.pending = None
        self.refused = reason


class _Worker:
    """The long-lived worker process of one env: requests by id, replies routed back to their futures."""

    def __init__(self, process: asyncio.subprocess.Process, log: str | None) -> None:
        self.process = process
        self.futures: dict[int, asyncio.Future] = {}
        self.ids = iter(range(1, 1 << 62))
        self.tail: deque[str] = deque(maxlen=_STDERR_TAIL)
        self.log = open(log, "a") if log else None  # noqa: SIM115 - open while the worker lives
        self.readers = [asyncio.create_task(self._replies()), asyncio.create_task(self._stderr())]

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def send(self, request: dict[str, Any]) -> tuple[int, asyncio.Future]:
        rid = next(self.ids)
        future = asyncio.get_running_loop().create_future()
        self.futures[rid] = future
        self.process.stdin.write((json.dumps({"id": rid, **request}) + "\n").encode())
        return rid, future

    def cancel(self, rid: int) -> None:
        if self.alive and rid in self.futures:
            self.process.stdin.write((json.dumps({"op": "cancel", "target": rid}) + "\n").encode())

    async def _replies(self) -> None:
        while line := await self.process.stdout.readline():
            message = json.loads(line)
            future = self.futures.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        await self.process.wait()
        died = EnvError(f"the verifiers worker exited with status {self.process.returncode}: {self.stderr_tail()}")
        for future in self.futures.values():
            if not future.done():
                future.set_exception(died)
        self.futures.clear()

    async def _stderr(self) -> None:
        while line := await self.process.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.tail.append(text)
            if self.log is not None:
                self.log.write(text + "\n")
                self.log.flush()

    def stderr_tail(self) -> str:
        return " | ".join(self.tail)[-2000:] or "(no stderr)"

    def close(self) -> None:
        if self.alive and self.process.stdin is not None:
            self.process.stdin.close()  # end of stdin: the worker leaves serving() and exits


class VerifiersEnv(Environment):
    """A ``verifiers.v1`` environment (a taskset, its Env and harness) played with tito's engines."""

    name = "verifiers"
    Options = VerifiersOptions

    def __init__(self, options: EnvOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.python = self.options.python or sys.executable
        if not Path(self.python).is_file():
            raise EnvError(f"environment 'verifiers': python {self.python!r} is not a file")
        self.env_id = self._oneshot([])["env_id"]  # the config resolves and the env loads: else one EnvError now
        self._worker: _Worker | None = None
        self._endpoint: Endpoint | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}  # a lock serves one event loop

    # -- the worker -----------------------------------------------------------------------------------

    def _worker_env(self, secret: str = "") -> dict[str, str]:
        env = dict(os.environ)
        env[KEY_VAR] = secret
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def _oneshot(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        """Load the env in a short-lived worker, answer ``requests`` in order, return the last reply (load's when
        there are none). Any failure is one EnvError naming it."""
        lines = [{"id": 0, "op": "load", "config": self.options.config}]
        lines += [{"id": i + 1, **r} for i, r in enumerate(requests)]
        try:
            done = subprocess.run([self.python, "-u", str(WORKER)], input="".join(json.dumps(x) + "\n" for x in lines),
                                  capture_output=True, text=True, timeout=self.options.start_timeout_s,
                                  env=self._worker_env())
        except subprocess.TimeoutExpired:
            raise EnvError(f"environment 'verifiers': loading {self._taskset()!r} took more than start_timeout_s "
                           f"{self.options.start_timeout_s:g}") from None
        replies = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        if "No module named 'verifiers'" in done.stderr + "".join(r.get("error", "") for r in replies):
            raise EnvError(f"environment 'verifiers': {self.python} cannot import verifiers; install "
                           "verifiers 0.4 there or set env.options.python to an interpreter that has it")
        if not replies:
            tail = " | ".join(done.stderr.strip().splitlines()[-8:])[-1500:]
            raise EnvError(f"environment 'verifiers': the worker ({self.python}) exited with status "
                           f"{done.returncode}: {tail}")
        for reply in replies:
            if "error" in reply:
                what = "loading the env" if reply["id"] == 0 else "listing its tasks"
                raise EnvError(f"environment 'verifiers': {what} ({self._taskset()!r}) failed: {reply['error']}")
        return replies[-1]

    def _taskset(self) -> str:
        return self.options.config["taskset"]["id"]

    async def _running_worker(self) -> tuple[_Worker, Endpoint]:
        loop = asyncio.get_running_loop()
        async with self._starting.setdefault(loop, asyncio.Lock()):
            if self._endpoint is None or self._loop is not loop:  # one endpoint per event loop, for every worker
                endpoint = Endpoint()
                await endpoint.start()
                self._endpoint, self._loop, self._worker = endpoint, loop, None
            if self._worker is None or not self._worker.alive:
                process = await asyncio.create_subprocess_exec(
                    self.python, "-u", str(WORKER), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, env=self._worker_env(self._endpoint.secret), limit=1 << 26)
                worker = _Worker(process, self.options.log)
                _, loaded = worker.send({"op": "load", "config": self.options.config})
                reply = await asyncio.wait_for(loaded, self.options.start_timeout_s)
                if "error" in reply:
                    worker.close()
                    raise EnvError(f"environment 'verifiers': loading {self._taskset()!r} failed: {reply['error']}")
                self._worker = worker
            return self._worker, self._endpoint

    # -- the protocol ---------------------------------------------------------------------------------

    def generate_tasks(self, n: int, seed: int) -> list[Task]:
        listed = self._oneshot([{"op": "tasks", "n": n, "seed": seed}])["tasks"]
        return [_task(self.env_id, n, seed, t) for t in listed]

    async def reset(self, task: Task) -> RolloutState:
        where = task.metadata.get("verifiers")
        if not isinstance(where, dict) or where.get("env_id") != self.env_id:
            raise EnvError(f"environment 'verifiers': task {task.task_id!r} is not one of {self.env_id!r}'s tasks "
                           "(its tasks come from the taskset: tasks.count and tasks.seed, not a tasks file)")
        worker, endpoint = await self._running_worker()
        key = uuid.uuid4().hex
        calls: asyncio.Queue[ModelCall] = asyncio.Queue()
        endpoint.episodes[key] = calls
        rid, done = worker.send({"op": "run", "n": where["n"], "seed": where["seed"], "position": where["position"],
                                 "base_url": endpoint.base_url(key), "api_key_var": KEY_VAR,
                                 "model": self.options.model})
        episode = _Episode(key, calls, done)
        state = RolloutState(task=task, data={"episode": episode})
        # a rollout that ends without score() (cancelled, an engine fault) must not leave its episode running
        weakref.finalize(state, _abandon, asyncio.get_running_loop(), worker, endpoint, episode, rid)
        first = await episode.next_call()
        if first is None:
            raise EnvError(f"environment 'verifiers': the episode of {task.task_id!r} ended before its first model "
                           f"call: {_verdict(done.result())}")
        state.prompt = [_tito_message(m) for m in first.messages]
        state.tools = first.tools
        episode.shown = list(first.messages)
        return state

    async def step(self, state: RolloutState, parsed: ParsedResponse) -> StepResult:
        self._begin_step(state, parsed)
        episode: _Episode = state.data["episode"]
        message = parsed.to_message(arguments="json")
        episode.answer(Reply(message, "tool_calls" if message.get("tool_calls") else "stop"))
        call = await episode.next_call()
        if call is None:
            state.done = True
            return StepResult(new_messages=[], done=True)
        new = _past(episode.shown, call.messages)
        episode.shown = list(call.messages)
        return StepResult(new_messages=[_tito_message(m) for m in new], done=False)

    async def score(self, state: RolloutState, trajectory: Sequence[Message]) -> Score:
        episode: _Episode = state.data["episode"]
        sampled = sum(1 for m in trajectory if m.get("role") == "assistant")
        while not episode.done.done():
            if episode.pending is not None:
                if sampled > episode.answered:  # tito's loop stopped on this sample (length, budget, context)
                    last = next(m for m in reversed(trajectory) if m.get("role") == "assistant")
                    episode.answer(Reply(_wire(last), "length"))
                else:  # a call after tito's last turn (max_turns)
                    episode.refuse("tito ended this rollout: its max_turns, token budget or context limit")
            await episode.next_call()
        result = episode.done.result()
        if "error" in result or "cancelled" in result:
            raise EnvError(f"the verifiers worker failed the episode: {result.get('error', 'cancelled')}")
        verdict = result["episode"]
        if not verdict["ok"] and episode.refused is None:
            raise EnvError(f"the verifiers episode of {state.task.task_id!r} failed: {_verdict(result)}")
        components = {k: float(v) for k, v in verdict["rewards"].items()}
        components.update({f"metric/{k}": float(v) for k, v in verdict["metrics"].items()
                           if isinstance(v, (int, float))})
        return Score(reward=float(verdict["reward"]), components=components)


def _task(env_id: str, n: int, seed: int, listed: dict[str, Any]) -> Task:
    data = listed["data"]
    messages: list[Message] = []
    if isinstance(data.get("system_prompt"), str) and data["system_prompt"]:
        messages.append({"role": "system", "content": data["system_prompt"]})
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif isinstance(prompt, list):
        messages.extend(_tito_message(m) for m in prompt if isinstance(m, dict))
    answer = data.get("answer")
    return Task(task_id=str(listed["name"]), messages=messages, answer=None if answer is None else str(answer),
                metadata={"verifiers": {"env_id": env_id, "n": n, "seed": seed, "position": listed["position"],
                                        "data": data}})


def _tito_message(message: dict[str, Any]) -> Message:
    """A wire message as tito's renderers take it: text parts joined, null content empty, tool-call arguments
    left as the harness sent them (their JSON string)."""
    out = {k: v for k, v in message.items() if v is not None}
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        out["content"] = "".join(p.get("text", "") for p in content)
    elif content is None:
        out["content"] = ""
    return out


def _wire(message: Message) -> dict[str, Any]:
    """A loop's assistant message as the OpenAI wire has it: its tool-call arguments are JSON strings, where the
    loop keeps them as its template wants them (``history_arguments``: a dict for most)."""
    out = {k: v for k, v in message.items() if k in ("role", "content", "reasoning_content", "tool_calls")}
    if out.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": a if isinstance(
            a := c["function"].get("arguments"), str) else json.dumps(a, ensure_ascii=False)}}
            for c in out["tool_calls"]]
    return out


def _past(shown: list[Message], sent: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages of ``sent`` after the conversation the harness was shown, or EnvError where it rewrote it."""
    if len(sent) <= len(shown):
        raise EnvError(f"the verifiers harness sent {len(sent)} messages after a conversation of {len(shown)}: "
                       "it dropped or replaced history, which tito cannot record append-only")
    for i, (before, now) in enumerate(zip(shown, sent)):
        if before.get("role") != now.get("role"):
            raise EnvError(f"the verifiers harness rewrote message {i} (role {before.get('role')!r} -> "
                           f"{now.get('role')!r}): tito records conversations append-only")
        if now.get("role") != "assistant" and _text(before) != _text(now):
            raise EnvError(f"the verifiers harness rewrote message {i} ({now.get('role')}): its content changed, "
                           "which tito cannot record append-only")
    new = sent[len(shown):]
    if any(m.get("role") == "assistant" for m in new):
        raise EnvError("the verifiers harness added an assistant message tito did not sample")
    return new


def _text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _verdict(result: dict[str, Any]) -> str:
    if "error" in result:
        return result["error"]
    episode = result.get("episode", {})
    return "; ".join(episode.get("errors") or []) or f"stop {episode.get('stop')}"


def _abandon(loop: asyncio.AbstractEventLoop, worker: _Worker, endpoint: Endpoint, episode: _Episode,
             rid: int) -> None:
    def cancel() -> None:
        endpoint.episodes.pop(episode.key, None)
        if not episode.done.done():
            episode.refuse("tito abandoned this rollout")
            worker.cancel(rid)

    if not loop.is_closed():
        loop.call_soon_threadsafe(cancel)
