"""One way to call a component whether it is a local object or a Ray actor.

``await call(target, "generate", request)`` runs ``target.generate.remote(request)`` on an actor
handle, or ``target.generate(request)`` (awaited if it returns an awaitable) on a plain object. The
rollout loop is written once against this, and the tests drive it without Ray.
"""

from __future__ import annotations

import inspect
from typing import Any


async def call(target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    fn = getattr(target, method)
    remote = getattr(fn, "remote", None)
    if remote is not None:
        return await remote(*args, **kwargs)
    out = fn(*args, **kwargs)
    if inspect.isawaitable(out):
        out = await out
    return out
