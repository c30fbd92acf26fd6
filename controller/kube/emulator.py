"""An API server in this process: kmock's Kubernetes emulator, taught what the operator needs.

The operator is tested (and benchmarked) against real HTTP, the real kopf and
the real `kubernetes` client; only the API server is a stand-in. kmock's
`KubernetesEmulator` keeps objects in memory and serves list, watch, get,
create, merge/JSON patch and delete. On its own it leaves out a few things
a controller relies on, which this subclass adds, each the way a real API
server does it:

- every object gets `uid`, `creationTimestamp`, `generation` and a
  `resourceVersion` that changes on every write (kopf's finalizer patch tests
  it; our master promotion uses it as a compare-and-swap precondition: a merge
  patch naming a stale `metadata.resourceVersion` is refused with 409);
- `metadata.generateName` on create (kopf posts its Events that way);
- creating a CustomResourceDefinition makes its resource discoverable, with
  the verbs and subresources it declares, so CRDs are installed through the
  API as on a real cluster;
- watches that start after the `resourceVersion` a client listed, losing no
  write made while the watch starts (kmock replays everything and may miss one);
- equality `labelSelector`s on lists and watches (`a=b,c=d`), as the operator's
  own lists of Pods and kopf's watches rely on them;
- Pod logs (`pods/<name>/log`) from `logs[(namespace, name)]`, which a test fills
  in to play the kubelet.

Left out, as in kmock: garbage collection of owned objects, strategic merge
patches, PUT, server-side schema validation (tests validate against the CRD
schema with jsonschema themselves), and the cluster-wide `/api/v1/namespaces`
(kmock cannot parse that path), so kopf runs here with its namespace and CRD
scanning off (`AUTOLAB_KOPF_SCANNING=0`, `autolab operator --no-scanning`).

`python -m controller.kube.emulator [--port N]` serves one on localhost (the
operator benchmark runs it in its own process that way).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import secrets
import uuid
import warnings
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import rendering  # the request type the handler hooks receive

from controller.lab.clock import utcnow

MUTATING = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
SUBRESOURCES_SERVED = (None, "status")
CRDS = kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
CR_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


class _DirectRoutes(kmock.RawHandler):
    """Serve object requests straight from the emulator's handlers.

    kmock matches every request against its reactions, and a reaction looks
    through every request served so far; that is made for tests of a few dozen
    requests and grows quadratically with more. Requests for objects go
    directly to the emulator's own list/watch/get/create/patch/delete instead;
    discovery and anything else still go through kmock's reactions.
    """

    __slots__ = ()

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        serve = None
        if res is not None and res.plural and request.subresource in SUBRESOURCES_SERVED:
            serve = {kmock.action.LIST: "_serve_list", kmock.action.WATCH: "_serve_watch",
                     kmock.action.FETCH: "_serve_fetch", kmock.action.CREATE: "_serve_create",
                     kmock.action.UPDATE: "_serve_update",
                     kmock.action.DELETE: "_serve_delete"}.get(request.action)
        if serve is None:
            return await super()._handle(request)
        return await rendering.Response(payload=getattr(self, serve))(request)


class Emulator(kmock.KubernetesEmulator, _DirectRoutes):
    """kmock's emulator with resource versions, generateName, CRD discovery and selectors.

    `keep_requests`: remember only about that many of the latest requests
    (`requests`), for long runs; None keeps them all, for assertions.
    """

    def __init__(self, *args: Any, keep_requests: int | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.keep_requests = keep_requests

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        with warnings.catch_warnings():  # kmock reads its catalogue with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.resources.load_bundled()
        self.logs: dict[tuple[str, str], str] = {}
        self._revision = 0
        self._writes = asyncio.Lock()

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _stored(self, request: rendering.Request) -> Any:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return self.objects[key]
        return None

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        if self.keep_requests and len(self._requests) > 2 * self.keep_requests:
            del self._requests[:-self.keep_requests]
        if request.action == kmock.action.FETCH and request.subresource == "log":
            return aiohttp.web.Response(text=self.logs.get((request.namespace, request.name), ""))
        if request.action not in MUTATING or request.resource is None:
            return await super()._handle(request)
        # One write at a time, so a precondition checked here still holds when kmock applies it.
        async with self._writes:
            if request.action == kmock.action.CREATE and isinstance(request.data, dict):
                self._on_create(request)
            elif request.action == kmock.action.UPDATE and request.data is not None:
                self._on_update(request)
            elif request.action == kmock.action.DELETE:
                stored = self._stored(request)
                if stored is not None:  # marking for deletion, or the deletion, is a write too
                    stored["metadata"]["resourceVersion"] = self._next_revision()
            return await super()._handle(request)

    def _on_create(self, request: rendering.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        key = (request.resource, request.namespace, meta.get("name"))
        if key not in self.objects or self.objects[key].deleted:  # a conflict keeps what is stored
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", utcnow())
            meta.setdefault("generation", 1)
            meta["resourceVersion"] = self._next_revision()
        if request.resource == CRDS:
            self._discover(request.data)

    def _on_update(self, request: rendering.Request) -> None:
        stored = self._stored(request)
        if stored is None:
            return  # kmock answers 404
        meta = stored.get("metadata", {})
        revision = self._next_revision()
        if isinstance(request.data, dict):
            wanted = (request.data.get("metadata") or {}).get("resourceVersion")
            if wanted is not None and wanted != meta.get("resourceVersion"):
                raise kmock.KubernetesError(
                    status=409, reason="Conflict",
                    message=f"Operation cannot be fulfilled on {request.resource.plural} "
                            f"{request.name!r}: the object has been modified; please apply your "
                            "changes to the latest version and try again")
            patch_meta = request.data.setdefault("metadata", {})
            patch_meta["resourceVersion"] = revision
            if request.subresource is None and "spec" in request.data:
                patch_meta["generation"] = int(meta.get("generation", 1)) + 1
        elif isinstance(request.data, list):
            for op in request.data:  # a failed JSON-patch test is 422, as the API server says
                if op.get("op") == "test":
                    try:
                        jsonpatch.JsonPatch([op]).apply(stored.raw)
                    except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPointerException) as e:
                        raise kmock.KubernetesError(status=422, reason="Invalid",
                                                    message=f"the test of {op.get('path')} "
                                                            f"failed: {e}") from None
            request.data.append({"op": "add", "path": "/metadata/resourceVersion",
                                 "value": revision})
            if request.subresource is None and any(
                    str(op.get("path", "")).startswith("/spec") for op in request.data):
                request.data.append({"op": "add", "path": "/metadata/generation",
                                     "value": int(meta.get("generation", 1)) + 1})

    def _discover(self, crd: dict) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            self.resources[f"{spec['group']}/{version['name']}/{names['plural']}"] = \
                kmock.ResourceInfo(kind=names.get("kind"), singular=names.get("singular"),
                                   namespaced=spec.get("scope") == "Namespaced", verbs=CR_VERBS,
                                   shortnames=names.get("shortNames") or [],
                                   subresources=list((version.get("subresources") or {})))

    async def _serve_list(self, request: rendering.Request) -> Any:
        listed = await super()._serve_list(request)
        listed["items"] = [o for o in listed["items"] if _selected(o, request)]
        listed["metadata"] = {"resourceVersion": str(self._revision)}
        return listed

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        """Changes after the `resourceVersion` asked for, none lost, none repeated.

        kmock's watch replays every object and then follows its bus from the moment it
        subscribes, so a write in between is lost and a client that watches from the
        version it listed (as kopf does) sees stale objects again. Here the bus is
        subscribed first, objects newer than the version asked for come next, and bus
        events the client has seen already are skipped.
        """
        yield b""  # the headers go now: the client is watching even if nothing happens
        bus = self._buses[request.resource]
        mark = await bus.mark()
        try:
            since = _revision(request.params.get("resourceVersion"))
            seen: dict[tuple[str | None, str], int] = {}
            async with self._lock:
                current = [o.raw for (r, ns, _), o in self.objects.items()
                           if r == request.resource and not o.deleted
                           and request.namespace in (None, ns)]
            for raw in current:
                version = _revision(raw["metadata"].get("resourceVersion"))
                if version > since and _selected(raw, request):
                    seen[_key(raw)] = version
                    yield {"type": "ADDED" if since == 0 else "MODIFIED", "object": raw}
            async for event in bus.stream(since=mark):
                raw = event.get("object") or {}
                if request.namespace not in (None, raw.get("metadata", {}).get("namespace")):
                    continue
                version = _revision(raw.get("metadata", {}).get("resourceVersion"))
                if event.get("type") != "DELETED" and version <= seen.get(_key(raw), since):
                    continue
                seen[_key(raw)] = version
                if _selected(raw, request):
                    yield event
        finally:
            await bus.unmark(mark)

    # -- conveniences for tests: read and write objects as the cluster would ----------------------
    @property
    def requests(self) -> list[rendering.Request]:
        """Every request served so far, oldest first."""
        return list(self._requests)

    def get(self, resource: str, namespace: str | None, name: str) -> dict | None:
        key = (kmock.resource(resource), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def items(self, resource: str, namespace: str | None = None) -> list[dict]:
        res = kmock.resource(resource)
        return [copy.deepcopy(o.raw) for (r, ns, _), o in self.objects.items()
                if r == res and not o.deleted and (namespace is None or ns == namespace)]


def _revision(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _key(raw: dict) -> tuple[str | None, str]:
    meta = raw.get("metadata") or {}
    return meta.get("namespace"), meta.get("name", "")


def _selected(obj: dict, request: rendering.Request) -> bool:
    """Does `obj` match the request's equality labelSelector (`a=b,c=d`), if it has one?"""
    selector = request.params.get("labelSelector")
    if not selector:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in selector.replace("==", "=").split(","):
        k, _, v = term.partition("=")
        if labels.get(k.strip()) != v.strip():
            return False
    return True


async def serve(port: int = 0) -> None:
    async with Emulator(keep_requests=1000) as emulator, \
            kmock.Server(emulator, port=port) as server:
        print(f"{server.url}".rstrip("/"), flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controller.kube.emulator",
                                description="Serve an in-memory Kubernetes API on localhost.")
    p.add_argument("--port", type=int, default=0, help="port (default: any free one)")
    a = p.parse_args(argv)
    try:
        asyncio.run(serve(a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
