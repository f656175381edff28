"""The trainer's end of weights over gloo: send a model's tensors to tito (or any server speaking vLLM's
weight-transfer routes with a gloo engine) with nothing but torch and the standard library.

    sender = GlooWeightSender("http://127.0.0.1:8000")   # the server's base URL (api_key= if it has one)
    sender.init()                                       # once: host the TCPStore, join as rank 0
    sender.send(model.named_parameters(), version=1)    # per step: start, update_weights + broadcast, finish
    sender.close()

What goes over the wire is vLLM's unpacked format (rollout/engines/weight_transfer.py): ``/update_weights
{update_info: {names, dtype_names, shapes}}`` announces the tensors while this process broadcasts each one from
rank 0, in that order. The server answers once it has them all; ``/finish_weight_update {weight_version}`` makes
them served. ``send`` does not pause the server: its engines stage what arrives and swap it in between two steps.
"""

from __future__ import annotations

import datetime
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class WeightSendError(RuntimeError):
    """A send that did not happen: the server refused a call (its answer quoted) or the group failed."""


def broadcast_tensors(group: Any, tensors: Iterable[Any]) -> int:
    """Broadcast each tensor from rank 0 over a gloo ``group``, in order; returns the bytes sent."""
    sent = 0
    for tensor in tensors:
        t = tensor.detach().contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        group.broadcast(t, 0).wait()
        sent += t.numel() * t.element_size()
    return sent


class GlooWeightSender:
    """Rank 0 of the weight-transfer group of a tito server (``engine.weight_transfer: gloo``).

    ``master_address`` must be reachable from the engines (loopback when they run on this machine); ``master_port``
    0 takes a free port. ``timeout_s`` bounds every wait on the group and each HTTP call."""

    def __init__(self, base_url: str, *, master_address: str = "127.0.0.1", master_port: int = 0,
                 timeout_s: float = 120.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.master_address = master_address
        self.master_port = master_port
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.store = None
        self.group = None
        self.world_size: int | None = None

    # -- HTTP ------------------------------------------------------------------------------------------------
    def call(self, method: str, route: str, body: dict | None = None, *, bounded: bool = True) -> dict:
        """One route; a non-2xx answer raises WeightSendError quoting it. ``bounded=False``: no bound on the answer
        (/update_weights answers once every tensor arrived, however long that takes; each tensor's wait is bounded
        by the group's own timeout)."""
        timeout = self.timeout_s * 2 + 30 if bounded else None
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + route, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                text = answer.read().decode()
        except urllib.error.HTTPError as exc:
            raise WeightSendError(f"{method} {route}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
        except urllib.error.URLError as exc:
            raise WeightSendError(f"{method} {route}: {exc.reason}") from None
        return json.loads(text) if text.strip() else {}

    def _post_meanwhile(self, route: str, body: dict, *, bounded: bool = True) -> tuple[ThreadPoolExecutor, Future]:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tito-weight-send")
        return pool, pool.submit(self.call, "POST", route, body, bounded=bounded)

    # -- the group -------------------------------------------------------------------------------------------
    def init(self) -> None:
        """Host the TCPStore, then join the group as rank 0 while the server's engines join it
        (``/init_weight_transfer_engine``, whose ``world_size`` is 1 + the server's ``/get_world_size``)."""
        import torch.distributed as dist

        self.close_group()
        engines = int(self.call("GET", "/get_world_size")["world_size"])
        world = 1 + engines
        timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            # wait_for_workers=False: the engines connect once /init_weight_transfer_engine (sent below) reaches them
            store = dist.TCPStore(self.master_address, self.master_port, world, True, timeout=timeout,
                                  wait_for_workers=False)
        except Exception as exc:  # noqa: BLE001 - DistNetworkError, RuntimeError: the port is taken or unbound
            raise WeightSendError(f"cannot host the TCPStore on {self.master_address}:{self.master_port} "
                                  f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): the port "
                                  "is in use or the address is not this machine's; pass another master_port (0: a "
                                  "free one)") from None
        port = store.port
        init_info = {"master_address": self.master_address, "master_port": port, "rank_offset": 1,
                     "world_size": world}
        pool, answer = self._post_meanwhile("/init_weight_transfer_engine", {"init_info": init_info})
        try:
            group = dist.ProcessGroupGloo(store, 0, world, timeout)
            answer.result()
        except WeightSendError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engines never joined
            raise WeightSendError(f"the server's engines did not join the group on port {port} within "
                                  f"{self.timeout_s:g} s ({type(exc).__name__}: {exc})") from None
        finally:
            pool.shutdown(wait=False)
        self.store, self.group, self.world_size, self.master_port = store, group, world, port

    def send(self, named_tensors: Iterable[tuple[str, Any]], version: int | None = None) -> dict:
        """One weight update: ``start_weight_update``, ``update_weights`` while every tensor is broadcast, then
        ``finish_weight_update`` with ``version`` (None: the server takes its current version + 1). Returns the
        server's answers and the bytes sent."""
        if self.group is None:
            raise WeightSendError("send before init: call init() first (it joins the group)")
        items = [(name, tensor) for name, tensor in named_tensors]
        info = {"names": [n for n, _ in items],
                "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in items],
                "shapes": [list(t.shape) for _, t in items]}
        self.call("POST", "/start_weight_update", {})
        pool, answer = self._post_meanwhile("/update_weights", {"update_info": info}, bounded=False)
        outcome: dict[str, Any] = {}

        def push() -> None:
            try:
                outcome["bytes"] = broadcast_tensors(self.group, (t for _, t in items))
            except BaseException as exc:  # noqa: BLE001 - reported below
                outcome["error"] = exc

        pusher = threading.Thread(target=push, name="tito-weight-broadcast", daemon=True)
        pusher.start()
        try:
            updated = answer.result()  # a refusal comes back here while the broadcast may still wait on the engines
        except WeightSendError:
            self.close_group()  # the group is out of step: the next send needs init() again
            raise
        finally:
            pool.shutdown(wait=False)
        pusher.join(self.timeout_s)
        if "bytes" not in outcome:
            self.close_group()
            raise WeightSendError(f"broadcasting the tensors failed: {outcome.get('error', 'timed out')}")
        body = {} if version is None else {"weight_version": str(version)}
        finished = self.call("POST", "/finish_weight_update", body)
        return {"update": updated, "finish": finished, "bytes": outcome["bytes"], "tensors": len(items)}

    def close_group(self) -> None:
        self.group, self.store = None, None

    def close(self) -> None:
        """Tell the server to leave the group (``/shutdown_weight_transfer_engine``), then drop it here."""
        if self.group is not None:
            try:
                self.call("POST", "/shutdown_weight_transfer_engine", {})
            finally:
                self.close_group()
