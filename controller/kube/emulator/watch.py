"""The watch layer: a stream of changes from a `resourceVersion` on, none lost, none repeated.

A watch starts after the version a client listed: from the store's event log (a version older
than the log answers 410 Gone, and the client lists again), or, from version 0, with every
object as ADDED. Then it follows the store's writes. A watch filtered by selectors sees an
object that stops matching as DELETED and one that starts matching as ADDED; `timeoutSeconds`
ends it; a client that asked for a Table gets rows. A mixin of `Emulator` (`server`), over
`Store`'s state.
"""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

import aiohttp.web

from controller.kube.emulator.model import ApiError, Call
from controller.kube.emulator.selectors import field_selector, label_selector
from controller.kube.emulator.tables import as_table, wants_table


class Watches:
    """Serves `?watch=true` requests from the store's event log and its writes."""

    async def _serve_watch(self, call: Call) -> aiohttp.web.StreamResponse:
        """Changes after the `resourceVersion` asked for, none lost, none repeated."""
        if call.name is not None:  # a watch of one object is a watch with a field selector
            selector = call.request.params.get("fieldSelector")
            extra = f"metadata.name={call.name}"
            call.request.params["fieldSelector"] = f"{selector},{extra}" if selector else extra
        labels = label_selector(call.request.params.get("labelSelector", ""))
        fields = field_selector(call)

        def matches(obj: dict | None) -> bool:
            return obj is not None and \
                call.namespace in (None, obj["metadata"].get("namespace")) and \
                labels(obj) and fields(obj)

        table = wants_table(call.header("Accept"))
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(call.request._raw_request)
        queue: asyncio.Queue = asyncio.Queue()
        since = _revision(call.request.params.get("resourceVersion"))
        # No await from here to the subscription: no write can fall in between.
        if since == 0:
            backlog = [(0, call.key, "ADDED", o, None)
                       for o in self._list(call)["items"]]
        elif since < self._log_floor:
            backlog = None
        else:
            backlog = [e for e in self._log if e[1] == call.key and e[0] > since]
        self._watchers[call.key].add(queue)
        first = True
        try:
            if backlog is None:
                gone = ApiError(410, "Expired", f"too old resource version: {since} "
                                                f"({self._log_floor})").status()
                await response.write(json.dumps({"type": "ERROR", "object": gone}).encode()
                                     + b"\n")
                return response
            timeout = _revision(call.request.params.get("timeoutSeconds")) or None
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            pending = collections.deque(backlog)
            while True:
                if pending:
                    _, _, kind, new, old = pending.popleft()
                else:
                    left = None if deadline is None else deadline - loop.time()
                    if left is not None and left <= 0:
                        break
                    try:
                        _, _, kind, new, old = await asyncio.wait_for(queue.get(), left)
                    except asyncio.TimeoutError:
                        break
                kind = _filtered(kind, matches(new), matches(old))
                if kind is None:
                    continue
                obj = as_table(call, [new], self._revision, headers=first) if table else new
                first = False
                await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._watchers[call.key].discard(queue)
        return response


def _revision(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _filtered(kind: str, now: bool, before: bool) -> str | None:
    """The event a filtered watch sees: an object that starts or stops matching comes or goes."""
    if kind != "MODIFIED":
        return kind if now or (kind == "DELETED" and before) else None
    if now:
        return "MODIFIED" if before else "ADDED"
    return "DELETED" if before else None
