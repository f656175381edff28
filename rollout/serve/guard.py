"""What every request passes before a route sees it (a plain ASGI middleware around the app): the API key
check and the body deadline.

API keys (``server.api_key`` / ``TITO_API_KEY``, ``server.admin_api_key`` / ``TITO_ADMIN_API_KEY``): as
vLLM's ``--api-key``, a request must carry ``Authorization: Bearer <key>``, else it is refused with 401
before its body is read. vLLM guards only its ``/v1``, ``/inference`` ... prefixes; here every route is
guarded but ``/health`` and ``/liveness`` (probes that say only whether the server and engines are up), since
the admin routes (weights, pause, sleep) are the ones an open port must not give away. With an admin key,
the routes in ADMIN_PATHS take that key alone; the other routes take either key. Keys are compared as
SHA-256 digests with ``hmac.compare_digest`` (the time taken says nothing about how much of a guess was
right) and are never logged or answered.

Body deadline (``server.body_timeout_s``): uvicorn times out idle keep-alive connections but not a body
that stops arriving, so a client that announces ``Content-Length: 100`` and sends 10 bytes would hold its
request (and a worker's await) forever. Here each ``receive()`` of the body waits at most until the
deadline (the request's start + ``body_timeout_s``); past it the route's read raises :class:`BodyTimeout`,
answered with 408 and ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Any

from .calls import error_response
from .schemas import BadRequest

OPEN_PATHS = frozenset({"/health", "/liveness"})
ADMIN_PATHS = frozenset({"/pause", "/resume", "/update_weights", "/sleep", "/wake_up", "/reset_prefix_cache",
                         "/init_broadcaster", "/init_weight_transfer_engine", "/load_lora_adapter",
                         "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/shutdown_weight_transfer_engine",
                         "/start_weight_update", "/finish_weight_update", "/update_weight_version", "/weight_checker",
                         "/collective_rpc"})


class BodyTimeout(BadRequest):
    """408: the request body did not arrive in full within ``server.body_timeout_s``."""

    status = 408
    kind = "RequestTimeoutError"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


class Guard:
    """ASGI middleware: API keys, then the body deadline, around ``app``."""

    def __init__(self, app: Any, *, api_key: str | None, admin_api_key: str | None, body_timeout_s: float) -> None:
        self.app = app
        self.body_timeout_s = body_timeout_s
        self._user = _digest(api_key) if api_key else None
        self._admin = _digest(admin_api_key) if admin_api_key else None

    def _allowed(self, path: str, headers: list[tuple[bytes, bytes]]) -> bool:
        if path in OPEN_PATHS:
            return True
        wanted = [self._admin or self._user] if path in ADMIN_PATHS else [self._user, self._admin]
        wanted = [w for w in wanted if w is not None]
        if not wanted:
            return True  # no key configured for this route
        value = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = value.decode("latin-1").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = hashlib.sha256(token.strip().encode("latin-1")).digest()
        ok = False
        for w in wanted:  # every key is compared, whichever matches
            ok |= hmac.compare_digest(given, w)
        return ok

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("method") != "OPTIONS" and not self._allowed(scope["path"], scope["headers"]):
            admin = scope["path"] in ADMIN_PATHS and self._admin is not None
            response = error_response(401, "Unauthorized: send 'Authorization: Bearer <key>' with the server's "
                                      + ("admin API key (server.admin_api_key)" if admin else
                                         "API key (server.api_key)"), "AuthenticationError")
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, self._timed(receive), send)

    def _timed(self, receive: Any) -> Any:
        deadline = time.monotonic() + self.body_timeout_s
        done = False

        async def timed_receive() -> dict:
            nonlocal done
            if done:  # the body is in: later messages (the disconnect) are waited for as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except TimeoutError:
                raise BodyTimeout(f"the request body did not arrive in full within {self.body_timeout_s:g} s "
                                  "(server.body_timeout_s)") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                done = True
            return message

        return timed_receive
