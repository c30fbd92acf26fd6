"""The HTTP layer: the `Emulator`, an API server behind kmock's HTTP server.

Each request is taken apart here (its path into group, version, resource, namespace, name and
subresource; a JSON or protobuf body), recorded the way kmock records requests (`requests`),
and answered: discovery and OpenAPI paths by `Discovery`, `?watch=true` by `Watches`, every
other verb on a resource by `Store`, and a Pod's log from `logs`. A refusal (`ApiError`) from
any layer becomes the `Status` object a real server sends; a bug here becomes a 500 with the
traceback on stderr. Answers are JSON, or Tables for a client that asks for them.

`serve()` and `main()` run one on localhost (`python -m controller.kube.emulator`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import traceback
import warnings
from collections.abc import Iterable
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import rendering  # the request type kmock records

from controller.kube.emulator.discovery import Discovery
from controller.kube.emulator.model import ApiError, Call
from controller.kube.emulator.protobuf import from_protobuf
from controller.kube.emulator.store import Store
from controller.kube.emulator.tables import as_table, wants_table
from controller.kube.emulator.watch import Watches

PROTOBUF = "application/vnd.kubernetes.protobuf"


class Emulator(Discovery, Watches, Store, kmock.KubernetesEmulator):
    """An in-memory Kubernetes API server (see the package docstring for what it serves).

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
        self._init_store()
        self.logs: dict[tuple[str, str], str] = {}   # a Pod's log, by (namespace, name)
        self._openapi_cache: tuple[int, dict] | None = None
        self._info_cache: tuple[int, dict] | None = None

    # -- HTTP entry ------------------------------------------------------------------------------
    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        await raw.read()
        if self.keep_requests and len(self._requests) > 2 * self.keep_requests:
            del self._requests[:-self.keep_requests]
        try:
            call, request = await self._parse(raw)
            self._requests.append(request)
            if call is None:
                return await self._serve_other(request)
            return await self._serve(call)
        except ApiError as e:
            return _json(e.status(), status=e.code)
        except Exception as e:  # a bug here: say so as a Status, and on stderr
            traceback.print_exc()
            return _json(ApiError(500, "InternalError", f"emulator: {e!r}").status(), status=500)

    async def _parse(self, raw: aiohttp.web.BaseRequest) -> tuple[Call | None, rendering.Request]:
        data: Any = None
        text = "" if raw.content_type == PROTOBUF else await raw.text()
        if raw.content_type == PROTOBUF:  # kubectl's typed clients (create namespace, ...)
            data, text = from_protobuf(await raw.read()), ""
        elif text:
            try:
                data = json.loads(text)
            except ValueError:
                if raw.method in ("POST", "PUT", "PATCH") and \
                        not raw.content_type.startswith("application/apply-patch"):
                    raise ApiError(400, "BadRequest", "the request body is not JSON") from None
        target = _parse_path(raw.path)
        action = None
        if target is not None and target[2] is not None:
            action = _action(raw.method, raw.query.get("watch") in ("true", "1"), target[4])
        request = rendering.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method,
            params=dict(raw.query), headers=dict(raw.headers), cookies=dict(raw.cookies),
            data=data, body=text.encode(), text=text, action=action,
            resource=None if target is None else _resource(target[0], target[1], target[2]),
            namespace=None if target is None else target[3],
            name=None if target is None else target[4],
            subresource=None if target is None else target[5])
        if target is None or target[2] is None:
            return None, request
        group, version, plural, namespace, name, sub = target
        return Call((group, version, plural), namespace, name, sub, request), request

    async def _serve_other(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        path = request.url.path.rstrip("/") or "/"
        if request.method != "GET":
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow this method on "
                                                    f"the requested resource ({path})")
        if path == "/version":
            return _json({"major": "1", "minor": "32", "gitVersion": "v1.32.0-autolab-emulator",
                          "platform": "linux/amd64", "goVersion": "none", "compiler": "none",
                          "gitCommit": "", "gitTreeState": "clean", "buildDate": ""})
        if path == "/api":
            return _json({"kind": "APIVersions", "versions": ["v1"],
                          "serverAddressByClientCIDRs": []})
        if path == "/apis":
            return _json({"kind": "APIGroupList", "apiVersion": "v1",
                          "groups": [self._group_doc(g) for g in self._groups() if g]})
        if path in ("/", "/healthz", "/readyz", "/livez"):
            return aiohttp.web.Response(text="ok")
        if path == "/openapi/v2":
            return self._serve_openapi_v2(request)
        if path == "/openapi/v3":
            docs = self._openapi_v3()
            return _json({"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={h}"}
                                    for gv, (h, _) in sorted(docs.items())}})
        if path.startswith("/openapi/v3/"):
            doc = self._openapi_v3().get(path[len("/openapi/v3/"):])
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _json(doc[1])
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) == 2:
            return _json(self._resource_list("", parts[1]))
        if parts[0] == "apis" and len(parts) == 2 and parts[1] in self._groups():
            return _json({"kind": "APIGroup", "apiVersion": "v1", **self._group_doc(parts[1])})
        if parts[0] == "apis" and len(parts) == 3 and parts[2] in self._groups().get(parts[1], ()):
            return _json(self._resource_list(parts[1], parts[2]))
        raise ApiError(404, "NotFound", "the server could not find the requested resource")

    def _serve_openapi_v2(self, request: rendering.Request) -> aiohttp.web.Response:
        accept = request.headers.get("Accept", "*/*")
        if "json" not in accept and "*/*" not in accept:
            raise ApiError(406, "NotAcceptable", "the emulator serves /openapi/v2 as JSON only; "
                                                 "kubectl reads /openapi/v3")
        return _json(self._openapi_v2())

    # -- dispatch --------------------------------------------------------------------------------
    async def _serve(self, call: Call) -> aiohttp.web.StreamResponse:
        info = self._infos().get(call.key)
        if info is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        call.info, call.crd = info, self._crds.get(call.key)
        if info.namespaced is False and call.namespace is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        method, req = call.request.method, call.request
        if call.subresource == "log" and call.key == ("", "v1", "pods") and method == "GET":
            return self._serve_log(call)
        if call.subresource not in (None, "status") or \
                (call.subresource == "status" and "status" not in info.subresources):
            raise ApiError(404, "NotFound", f"the emulator does not serve "
                                            f"{call.key[2]}/{call.subresource}")
        if call.name is None:
            if method == "GET" and req.params.get("watch") in ("true", "1"):
                return await self._serve_watch(call)
            if method == "GET":
                return self._respond(call, self._list(call))
            if method == "POST":
                obj, warns = await self._create(call, req.data)
                return self._respond(call, obj, status=201, warns=warns)
            if method == "DELETE":
                return _json(await self._delete_collection(call))
        else:
            if method == "GET" and req.params.get("watch") in ("true", "1"):
                return await self._serve_watch(call)
            if method == "GET":
                return self._respond(call, self._fetch(call))
            if method in ("PUT", "PATCH"):
                obj, warns = await self._write(call, req.data, patch=method == "PATCH")
                return self._respond(call, obj, warns=warns)
            if method == "DELETE":
                return self._respond(call, await self._delete(call, req.data))
        raise ApiError(405, "MethodNotAllowed",
                       "the server does not allow this method on the requested resource")

    def _respond(self, call: Call, obj: dict, status: int = 200,
                 warns: Iterable[str] = ()) -> aiohttp.web.Response:
        if wants_table(call.header("Accept")):
            items = obj["items"] if obj.get("kind", "").endswith("List") and "items" in obj \
                else [obj]
            body = as_table(call, items, self._revision,
                            list_meta=obj.get("metadata") if "items" in obj else None)
            return _json(body, status=status, warns=warns)
        return _json(obj, status=status, warns=warns)

    def _serve_log(self, call: Call) -> aiohttp.web.Response:
        text = self.logs.get((call.namespace or "", call.name or ""))
        if text is None:
            self._fetch(call)  # 404 for a Pod that is not there
            text = ""
        return aiohttp.web.Response(text=text, content_type="text/plain")

    @property
    def requests(self) -> list[rendering.Request]:
        """Every request served so far, oldest first."""
        return list(self._requests)


@functools.lru_cache(maxsize=1024)
def _resource(group: str | None, version: str | None, plural: str | None) -> Any:
    """kmock's name of a resource (frozen, so one serves every request): 60 us to build."""
    return kmock.resource(group=group, version=version, plural=plural)


def _parse_path(path: str) -> tuple | None:
    """(group, version, plural, namespace, name, subresource) of an API path, or None."""
    parts = [p for p in path.split("/") if p]
    if len(parts) >= 2 and parts[0] == "api":
        group, version, rest = "", parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    if not rest:
        return group, version, None, None, None, None
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3 and \
            not (group == "" and len(rest) == 3 and rest[2] in ("status", "finalize")):
        namespace, rest = rest[1], rest[2:]
    plural, name = rest[0], rest[1] if len(rest) > 1 else None
    sub = "/".join(rest[2:]) or None
    return group, version, plural, namespace, name, sub


def _action(method: str, watch: bool, name: str | None) -> Any:
    a = kmock.action
    if method == "GET":
        return a.WATCH if watch else (a.FETCH if name else a.LIST)
    return {"POST": a.CREATE, "PUT": a.UPDATE, "PATCH": a.UPDATE, "DELETE": a.DELETE}.get(method)


def _json(body: Any, status: int = 200, warns: Iterable[str] = ()) -> aiohttp.web.Response:
    response = aiohttp.web.Response(text=json.dumps(body), status=status,
                                    content_type="application/json")
    for warning in warns:  # one header each, as the API server sends them
        response.headers.add("Warning", f"299 - {json.dumps(warning)}")
    return response


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
    sys.exit(main())
