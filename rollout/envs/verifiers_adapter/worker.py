"""The verifiers side of the adapter: a process that runs ``verifiers.v1`` episodes for tito.

Run by the interpreter that has verifiers (``env.options.python``), never imported by tito: it uses the standard
library and verifiers only, so verifiers' pinned dependencies (openai 2.x, PyPI ``renderers``, mcp) need not meet
tito's. It reads one JSON request a line on stdin and writes one JSON reply a line on the stdout it was started
with (everything else verifiers or its harnesses print goes to stderr). Requests carry an ``id``; replies echo it:

- ``{"op": "load", "config": {...}}``: build the env (``verifiers.v1.utils.loaders.load_environment`` on the
  resolved ``EnvConfig``) and enter its ``serving()``. Reply ``{"env_id", "infinite"}``.
- ``{"op": "tasks", "n", "seed"}``: the n tasks of that seed (a bounded taskset shuffled under ``seed``; an
  infinite one read in order from position ``seed * n``). Reply ``{"tasks": [{"position", "name", "data"}]}``.
- ``{"op": "run", "n", "seed", "position", "base_url", "api_key_var", "model"}``: one episode of that task, its
  agents' model calls sent to ``base_url`` (tito's endpoint for this rollout). Reply when it ends:
  ``{"episode": {"ok", "reward", "rewards", "metrics", "errors", "stop", "calls"}}``.
- ``{"op": "cancel", "target": id}``: cancel the episode of that run request (its reply is ``cancelled``).

A failed request replies ``{"id", "error": "..."}``. At end of stdin (tito closed it, or died) it leaves
``serving()`` and exits.
"""

import asyncio
import itertools
import json
import os
import sys
import traceback

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]  # this directory holds tito's modules, not the worker's imports

_REPLIES = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout ...
os.dup2(2, 1)  # ... and everything else printed to fd 1 (harness programs, verifiers' logs) goes to stderr
sys.stdout = sys.stderr


def reply(message: dict) -> None:
    _REPLIES.write(json.dumps(message, default=str) + "\n")
    _REPLIES.flush()


class Worker:
    def __init__(self) -> None:
        self.env = None
        self.serving = None
        self.tasks: dict[tuple[int, int], list] = {}
        self.running: dict[int, asyncio.Task] = {}

    async def load(self, config: dict) -> dict:
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        env = load_environment(resolve_env_config(config))
        self.serving = env.serving()
        await self.serving.__aenter__()
        self.env = env
        return {"env_id": env.config.env_id, "infinite": not env.taskset.bounded}

    def task_list(self, n: int, seed: int) -> list:
        key = (n, seed)
        if key not in self.tasks:
            taskset = self.env.taskset
            if taskset.bounded:
                view = iter(taskset.shuffle(seed=seed))
            else:
                view = itertools.islice(iter(taskset), seed * n, None)
            self.tasks[key] = list(itertools.islice(view, n))
        return self.tasks[key]

    def tasks_reply(self, n: int, seed: int) -> dict:
        out = []
        for position, task in enumerate(self.task_list(n, seed)):
            data = task.data.model_dump(mode="json")
            out.append({"position": position, "name": data.get("name") or f"{self.env.config.env_id}#{data.get('idx')}",
                        "data": data})
        return {"tasks": out}

    async def run(self, request: dict) -> dict:
        from verifiers.v1 import EvalClientConfig, ModelContext

        tasks = self.task_list(request["n"], request["seed"])
        task = tasks[request["position"]]
        client = EvalClientConfig(base_url=request["base_url"], api_key_var=request["api_key_var"])
        ctx = ModelContext(model=request["model"], client=client)
        episode = await self.env.run_episode(task, ctx)
        rewards: dict = {}
        metrics: dict = {}
        for trace in episode.traces:
            rewards.update({k: r.value for k, r in trace.rewards.items() if r is not None})
            metrics.update({k: v for k, v in trace.metrics.items() if v is not None})
        errors = [f"{e.type}: {e.message}" for e in episode.errors]
        errors += [f"{e.type}: {e.message}" for t in episode.traces for e in t.errors]
        return {"episode": {
            "ok": episode.ok,
            "reward": sum(t.reward for t in episode.traces),
            "rewards": rewards,
            "metrics": metrics,
            "errors": errors,
            "stop": [t.stop_condition for t in episode.traces],
            "calls": sum(len(t.calls) for t in episode.traces),
        }}

    async def answer(self, request: dict) -> None:
        rid = request.get("id")
        try:
            op = request["op"]
            if op == "load":
                out = await self.load(request["config"])
            elif op == "tasks":
                out = self.tasks_reply(request["n"], request["seed"])
            elif op == "run":
                out = await self.run(request)
            else:
                raise ValueError(f"unknown op {op!r}")
        except asyncio.CancelledError:
            out = {"cancelled": True}
        except Exception as e:  # every failure is a reply: tito decides what it costs
            out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        finally:
            self.running.pop(rid, None)
        reply({"id": rid, **out})

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 26)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while line := await reader.readline():
                request = json.loads(line)
                if request.get("op") == "cancel":
                    target = self.running.get(request.get("target"))
                    if target is not None:
                        target.cancel()
                    continue
                if request.get("op") in ("load", "tasks"):  # in order: a run needs what these built
                    await self.answer(request)
                    continue
                self.running[request.get("id")] = asyncio.create_task(self.answer(request))
        finally:
            for task in list(self.running.values()):
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)
            if self.serving is not None:
                await self.serving.__aexit__(None, None, None)


if __name__ == "__main__":
    asyncio.run(Worker().main())
