"""An API server in this process, close enough to a real one that `kubectl` cannot tell.

The operator is tested (and benchmarked) against real HTTP, the real kopf and
the real `kubernetes` client, and users try the README's cluster section with
the real `kubectl`; only the API server is a stand-in. It is built on kmock's
`KubernetesEmulator` (its HTTP server, its catalogue of the built-in
resources, its request records) but answers every request itself, the way the
Kubernetes API server does:

- **paths**: core (`/api/v1/...`) and group (`/apis/G/V/...`) resources,
  namespaced and cluster-scoped (`/api/v1/namespaces/NAME` is a Namespace,
  `/api/v1/namespaces/NS/pods/NAME/log` a Pod's log), their `status`
  subresource, discovery (`/api`, `/apis`, `/version`) and OpenAPI:
  `/openapi/v3` with one document per group-version (`/openapi/v3/apis/G/V`)
  and `/openapi/v2` (JSON), built from the CRDs' schemas, so `kubectl apply`
  validates on the server and `kubectl explain` reads the descriptions;
- **verbs**: get, list, watch, create, update (PUT), patch (merge, JSON and
  a strategic merge for the built-in kinds), delete, deletecollection, with
  `dryRun=All`, `labelSelector` (equality and set-based) and `fieldSelector`
  (`metadata.name`/`metadata.namespace` everywhere, `involvedObject.*` on
  Events, `spec.nodeName`/`status.phase` on Pods, ...);
- **objects** carry `apiVersion` and `kind` (lists too: `ExperimentList`),
  and `uid`, `creationTimestamp`, `generation` and a `resourceVersion` that
  changes on every write that changes something (a no-op write changes
  nothing and wakes no watch, as on a real server);
- **optimistic concurrency**: an update or patch naming a stale
  `metadata.resourceVersion` is refused with 409 Conflict (the master
  promotion's compare-and-swap relies on it); a PUT of a custom resource must
  name one;
- **status subresource**: where a CRD declares it, writes to the object keep
  the stored `.status`, writes to `/status` keep everything but `.status`,
  and `generation` moves only when something outside metadata and status
  changes;
- **deletion**: an object with finalizers gets `deletionTimestamp` at once
  (a MODIFIED event, so the operator's finalizer runs now, not at its next
  resync); the write that removes the last finalizer removes the object
  (DELETED); without finalizers a delete is immediate. `kubectl delete`
  then waits with a list and watch of that one name, which is why lists
  carry `kind` and honour `fieldSelector` (kmock's did neither, and kubectl
  backed off for seconds). Deleting a Namespace deletes what is in it,
  deleting a CRD deletes its objects;
- **custom resources are admitted as a real server admits them**: fields
  the schema does not know (outside `x-kubernetes-preserve-unknown-fields`)
  are pruned, and reported per `fieldValidation` (Strict: 400 `strict
  decoding error: unknown field "spec.foo"`; Warn, the default: a `Warning`
  header; Ignore); `default`s are filled in; the openAPIV3Schema is enforced
  (types, enum, pattern, lengths, bounds, required: 422 Invalid with the
  causes kubectl prints); `x-kubernetes-validations` are enforced for the
  rule forms this emulator evaluates (today `self == oldSelf`, the
  Experiment's immutable spec; a CRD with any other rule is refused when it
  is created, rather than accepted and left unchecked). A CRD's root
  `metadata` may restrict only `name` and `generateName`, as on a real server;
- **annotations** of any object hold 256 KiB at most, keys and values
  together (422 Invalid `metadata.annotations: Too long`);
- **watches** start after the `resourceVersion` a client listed and lose
  nothing in between (a version older than the server's event log answers
  410 Gone, and the client lists again); a watch filtered by selectors sees
  an object that stops matching as DELETED; `timeoutSeconds` ends it;
- **tables**: a client that asks for `as=Table;v=v1;g=meta.k8s.io` (kubectl
  get, also with -w) gets rows: the CRD's `additionalPrinterColumns` (their
  jsonPaths evaluated here; kubectl shows the priority>0 ones only with
  `-o wide`), and for the built-in kinds the columns `kubectl get` shows on
  a real cluster (Pods: READY, STATUS, RESTARTS; Jobs: STATUS, COMPLETIONS;
  Events: LAST SEEN, TYPE, REASON, OBJECT, MESSAGE; ...);
- **protobuf** request bodies of the kinds kubectl's typed clients send
  that way (`kubectl create namespace|configmap|secret`) are read; every
  answer is JSON, which all clients accept;
- Pod logs (`pods/NAME/log`) come from `logs[(namespace, name)]`, which a
  test fills in to play the kubelet.

Left out, each the job of something other than the API server or not used
here: garbage collection of owned objects (the controller manager's), the
Job and Pod controllers (tests play the kubelet), server-side apply
(`kubectl apply --server-side`: 415), other protobuf bodies (`kubectl create
job`: 415; `kubectl apply -f` sends JSON), protobuf OpenAPI v2, admission
webhooks, authentication, RBAC, CEL beyond the rule forms above, schemas of
the built-in kinds (no `kubectl explain pod`; their writes are not
schema-checked), a Namespace that must exist before objects are made in it,
and `limit`/`continue` paging (every list is one page).

`python -m controller.kube.emulator [--port N]` serves one on localhost and
prints its URL (the operator benchmark runs it in its own process that way).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import dataclasses
import datetime
import functools
import hashlib
import json
import re
import secrets
import sys
import traceback
import uuid
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import rendering  # the request type kmock records

from controller.lab.clock import utcnow

Key = tuple[str, str, str]                     # (group, version, plural)
ObjKey = tuple[Key, "str | None", str]         # (resource, namespace or None, name)

CRD_KEY: Key = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES: Key = ("", "v1", "namespaces")
SECRETS: Key = ("", "v1", "secrets")
EVENT_LOG_SIZE = 20_000        # watch events kept for clients resuming from a resourceVersion
SUPPORTED_RULES = ("self == oldSelf",)
OBJECT_META_FIELDS = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion",
                      "generation", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences",
                      "finalizers", "managedFields"}
SERVER_META_FIELDS = ("uid", "creationTimestamp", "generation", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "resourceVersion")
# Strategic merge patch: lists of the built-in kinds merged by a key rather than replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "volumes": "name", "env": "name", "imagePullSecrets": "name",
              "ports": "containerPort", "volumeMounts": "mountPath", "ownerReferences": "uid", "conditions": "type"}
FIELD_VALIDATION = ("Ignore", "Warn", "Strict")
# An object's annotations may hold this many bytes in all, keys and values (apimachinery's
# TotalAnnotationSizeLimitB), on every kind: a write past it is 422 Invalid.
ANNOTATIONS_MAX_BYTES = 256 * 1024
PROTOBUF = "application/vnd.kubernetes.protobuf"


class ApiError(Exception):
    """A refusal, answered as a `Status` object the way the API server words it."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        out = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            out["details"] = self.details
        return out


@dataclasses.dataclass
class Crd:
    """What the server knows of one served version of a CustomResourceDefinition."""

    group: str
    version: str
    kind: str
    list_kind: str
    plural: str
    namespaced: bool
    schema: dict
    columns: list[dict]
    status_subresource: bool


@dataclasses.dataclass
class Call:
    """One resource request, its path taken apart."""

    key: Key
    namespace: str | None
    name: str | None
    subresource: str | None
    request: rendering.Request
    crd: Crd | None = None
    info: Any = None

    @property
    def params(self) -> dict:
        return dict(self.request.params)

    def header(self, name: str) -> str:
        raw = self.request._raw_request
        return (raw.headers.get(name) if raw is not None else None) or ""

    @property
    def dry_run(self) -> bool:
        return self.request.params.get("dryRun") == "All"


# ------------------------------------------------------------------------------------------------
# The server
# ------------------------------------------------------------------------------------------------

class Emulator(kmock.KubernetesEmulator):
    """An in-memory Kubernetes API server (see the module docstring for what it serves).

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
        self.store: dict[ObjKey, dict] = {}
        self._by_resource: dict[Key, dict[tuple[str | None, str], dict]] = \
            collections.defaultdict(dict)
        self._crds: dict[Key, Crd] = {}
        self._revision = 0
        self._log: collections.deque = collections.deque(maxlen=EVENT_LOG_SIZE)
        self._log_floor = 0    # the newest resourceVersion no longer in the log
        self._watchers: dict[Key, set[asyncio.Queue]] = collections.defaultdict(set)
        self._writes = asyncio.Lock()
        self._openapi_cache: tuple[int, dict] | None = None
        self._schema_epoch = 0
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
            data, text = _from_protobuf(await raw.read()), ""
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

    # -- discovery -------------------------------------------------------------------------------
    def _infos(self) -> dict[Key, Any]:
        if self._info_cache is None or self._info_cache[0] != self._schema_epoch:
            self._info_cache = (self._schema_epoch, {(r.group, r.version, r.plural):
                                                     self.resources[r] for r in self.resources})
        return self._info_cache[1]

    def _groups(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = collections.defaultdict(list)
        for g, v, _ in sorted(self._infos()):
            if v not in groups[g]:
                groups[g].append(v)
        return groups

    def _group_doc(self, group: str) -> dict:
        versions = self._groups()[group]
        preferred = "v1" if "v1" in versions else versions[-1]
        return {"name": group,
                "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
                "preferredVersion": {"groupVersion": f"{group}/{preferred}",
                                     "version": preferred}}

    def _resource_list(self, group: str, version: str) -> dict:
        found = [(k, i) for k, i in sorted(self._infos().items()) if k[:2] == (group, version)]
        if not found:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        out = []
        for (_, _, plural), info in found:
            kind = info.kind or plural.capitalize()
            out.append({"name": plural, "singularName": info.singular or plural,
                        "namespaced": bool(info.namespaced), "kind": kind,
                        "verbs": sorted(info.verbs), "shortNames": sorted(info.shortnames),
                        "categories": sorted(info.categories)})
            for sub in sorted(info.subresources):
                out.append({"name": f"{plural}/{sub}", "singularName": "",
                            "namespaced": bool(info.namespaced), "kind": kind,
                            "verbs": ["get", "patch", "update"] if sub == "status" else ["get"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}".lstrip("/"), "resources": out}

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
        if _wants_table(call.header("Accept")):
            items = obj["items"] if obj.get("kind", "").endswith("List") and "items" in obj \
                else [obj]
            body = self._table(call, items, list_meta=obj.get("metadata") if "items" in obj
                               else None)
            return _json(body, status=status, warns=warns)
        return _json(obj, status=status, warns=warns)

    def _serve_log(self, call: Call) -> aiohttp.web.Response:
        text = self.logs.get((call.namespace or "", call.name or ""))
        if text is None:
            self._fetch(call)  # 404 for a Pod that is not there
            text = ""
        return aiohttp.web.Response(text=text, content_type="text/plain")

    # -- reading ---------------------------------------------------------------------------------
    def _fetch(self, call: Call) -> dict:
        obj = self._by_resource[call.key].get((call.namespace, call.name or ""))
        if obj is None:
            raise self._not_found(call)
        return obj

    def _list(self, call: Call) -> dict:
        labels = _label_selector(call.request.params.get("labelSelector", ""))
        fields = self._field_selector(call)
        items = [o for (ns, _), o in sorted(self._by_resource[call.key].items(),
                                            key=lambda kv: (kv[0][0] or "", kv[0][1]))
                 if call.namespace in (None, ns) and labels(o) and fields(o)]
        return {"apiVersion": _api_version(call.key), "kind": self._list_kind(call),
                "metadata": {"resourceVersion": str(self._revision)}, "items": items}

    def _list_kind(self, call: Call) -> str:
        if call.crd is not None:
            return call.crd.list_kind
        return f"{call.info.kind}List"

    def _not_found(self, call: Call) -> ApiError:
        what = _qualified(call.key)
        return ApiError(404, "NotFound", f'{what} "{call.name}" not found',
                        {"name": call.name, "group": call.key[0], "kind": call.key[2]})

    def _field_selector(self, call: Call) -> Callable[[dict], bool]:
        terms = _parse_field_selector(call.request.params.get("fieldSelector", ""))
        allowed = FIELD_LABELS.get(call.key[2], set()) | {"metadata.name", "metadata.namespace"}
        for field, _, _ in terms:
            if field not in allowed:
                raise ApiError(400, "BadRequest",
                               f'"{field}" is not a known field selector: only '
                               + ", ".join(f'"{f}"' for f in sorted(allowed)))

        def matches(obj: dict) -> bool:
            for field, op, value in terms:
                have = _field_value(obj, field)
                if (have == value) != (op == "="):
                    return False
            return True
        return matches

    # -- writing ---------------------------------------------------------------------------------
    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    def _commit(self, key: Key, kind: str, new: dict, old: dict | None, dry_run: bool) -> None:
        """Store (or forget) the object and tell the watchers; nothing of it on a dry run."""
        if dry_run:
            return
        meta = new["metadata"]
        okey = (meta.get("namespace"), meta["name"])
        meta["resourceVersion"] = self._next_revision()
        if kind == "DELETED":
            self._by_resource[key].pop(okey, None)
            self.store.pop((key, *okey), None)
        else:
            self._by_resource[key][okey] = new
            self.store[(key, *okey)] = new
        if len(self._log) == self._log.maxlen:
            self._log_floor = self._log[0][0]
        event = (self._revision, key, kind, new, old)
        self._log.append(event)
        for queue in self._watchers[key]:
            queue.put_nowait(event)
        if kind == "DELETED" and key != NAMESPACES and meta.get("namespace"):
            self._finish_namespace(meta["namespace"])

    async def _create(self, call: Call, body: Any) -> tuple[dict, list[str]]:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the body of a create must be a JSON object")
        async with self._writes:
            obj = copy.deepcopy(body)
            self._check_type(call, obj)
            meta = obj.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise ApiError(400, "BadRequest", "metadata must be an object")
            if call.info.namespaced:
                if call.namespace is None:
                    raise ApiError(404, "NotFound", "the server could not find the requested "
                                                    "resource (a namespaced kind needs a namespace "
                                                    "in the path)")
                if meta.get("namespace") not in (None, "", call.namespace):
                    raise ApiError(400, "BadRequest", "the namespace of the provided object does "
                                                      "not match the namespace sent on the request")
                meta["namespace"] = call.namespace
            else:
                meta.pop("namespace", None)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
            call.name = meta.get("name")
            if not call.name:
                raise self._invalid(call, obj, [_cause("FieldValueRequired", "metadata.name",
                                                       "Required value: name or generateName "
                                                       "is required")])
            if (call.namespace, call.name) in self._by_resource[call.key]:
                raise ApiError(409, "AlreadyExists",
                               f'{_qualified(call.key)} "{call.name}" already exists',
                               {"name": call.name, "group": call.key[0], "kind": call.key[2]})
            for field in SERVER_META_FIELDS:
                meta.pop(field, None)
            if call.crd is not None and call.crd.status_subresource:
                obj.pop("status", None)  # status is the controller's, written through /status
            warns = self._admit(call, obj, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=utcnow(), generation=1)
            if call.key == NAMESPACES:
                obj["status"] = {"phase": "Active"}
            if call.key == SECRETS:
                _secret_defaults(obj)
            if call.key == CRD_KEY:
                self._check_crd(obj)
                obj["status"] = _crd_status(obj)
            self._commit(call.key, "ADDED", obj, None, call.dry_run)
            if call.key == CRD_KEY and not call.dry_run:
                self._install_crd(obj)
            if not call.dry_run:  # tests tell created objects by the uid in the request they sent
                body.setdefault("metadata", {})["uid"] = meta["uid"]
            return obj, warns

    async def _write(self, call: Call, body: Any, patch: bool) -> tuple[dict, list[str]]:
        async with self._writes:
            old = self._fetch(call)
            if patch:
                new = self._patched(call, old, body)
            else:
                if not isinstance(body, dict):
                    raise ApiError(400, "BadRequest", "the body of an update must be an object")
                new = copy.deepcopy(body)
                self._check_type(call, new)
                named = (new.get("metadata") or {}).get("name")
                if named not in (None, call.name):
                    raise ApiError(400, "BadRequest", f"the name of the object ({named}) does not "
                                                      f"match the name on the URL ({call.name})")
                if call.crd is not None and not (new.get("metadata") or {}).get("resourceVersion"):
                    raise self._invalid(call, new, [_cause(
                        "FieldValueInvalid", "metadata.resourceVersion",
                        "Invalid value: 0x0: must be specified for an update")])
            if not isinstance(new, dict) or not isinstance(new.get("metadata", {}), dict):
                raise ApiError(422, "Invalid", "the patched object is not a Kubernetes object")
            wanted = (new.get("metadata") or {}).get("resourceVersion")
            if wanted not in (None, "") and str(wanted) != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict",
                               f'Operation cannot be fulfilled on {_qualified(call.key)} '
                               f'"{call.name}": the object has been modified; please apply your '
                               "changes to the latest version and try again",
                               {"name": call.name, "group": call.key[0], "kind": call.key[2]})
            return self._replace(call, old, new)

    def _patched(self, call: Call, old: dict, body: Any) -> dict:
        ctype = call.header("Content-Type").split(";")[0].strip()
        if ctype == "application/json-patch+json":
            if not isinstance(body, list):
                raise ApiError(400, "BadRequest", "a JSON patch is a list of operations")
            try:
                return jsonpatch.JsonPatch(body).apply(copy.deepcopy(old))
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise ApiError(422, "Invalid", f"the JSON patch could not be applied: {e}") \
                    from None
        if ctype == "application/merge-patch+json":
            return _merge_patch(old, body)
        if ctype == "application/strategic-merge-patch+json" and call.crd is None:
            return _strategic_merge(old, body)
        raise ApiError(415, "UnsupportedMediaType",
                       "the body of the request was in an unknown format - accepted media types "
                       "include: application/json-patch+json, application/merge-patch+json"
                       + ("" if call.crd else ", application/strategic-merge-patch+json")
                       + " (server-side apply is left out of the emulator)")

    def _replace(self, call: Call, old: dict, new: dict) -> tuple[dict, list[str]]:
        """Make `new` what the server stores in place of `old`, and store it if it differs."""
        new = copy.deepcopy(new)
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        status_sub = call.crd.status_subresource if call.crd else "status" in call.info.subresources
        if call.subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            new.pop("status", None)
            if status is not None:
                new["status"] = status
        elif call.crd is not None and status_sub:
            new.pop("status", None)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
        meta, was = new.setdefault("metadata", {}), old["metadata"]
        for field in ("name", "namespace", *SERVER_META_FIELDS):
            meta.pop(field, None)
            if field in was:
                meta[field] = was[field]
        if was.get("deletionTimestamp") and \
                set(meta.get("finalizers") or []) - set(was.get("finalizers") or []):
            raise self._invalid(call, new, [_cause(
                "FieldValueForbidden", "metadata.finalizers",
                "Forbidden: no new finalizers can be added if the object is being deleted")])
        warns = self._admit(call, new, old)
        if call.key == SECRETS:
            _secret_defaults(new)
        if self._spec_changed(call, old, new):
            meta["generation"] = int(was.get("generation", 1)) + 1
        if call.key == CRD_KEY:
            self._check_crd(new)
            new["status"] = _crd_status(new)
        if new == old:
            return old, warns
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._commit(call.key, "DELETED", new, old, call.dry_run)
            if call.key == CRD_KEY and not call.dry_run:
                self._uninstall_crd(new)
            return new, warns
        self._commit(call.key, "MODIFIED", new, old, call.dry_run)
        if call.key == CRD_KEY and not call.dry_run:
            self._install_crd(new)
        return new, warns

    def _spec_changed(self, call: Call, old: dict, new: dict) -> bool:
        if call.crd is None:
            return old.get("spec") != new.get("spec")
        skip = {"metadata", "status"} if call.crd.status_subresource else {"metadata"}
        return {k: v for k, v in old.items() if k not in skip} != \
            {k: v for k, v in new.items() if k not in skip}

    async def _delete(self, call: Call, options: Any) -> dict:
        async with self._writes:
            old = self._fetch(call)
            pre = (options or {}).get("preconditions") or {} if isinstance(options, dict) else {}
            for field, name in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                if pre.get(field) and pre[field] != old["metadata"].get(field):
                    raise ApiError(409, "Conflict",
                                   f"Precondition failed: {name} in precondition: {pre[field]}, "
                                   f"{name} in object meta: {old['metadata'].get(field)}")
            return self._remove(call.key, old, call.dry_run)

    def _remove(self, key: Key, old: dict, dry_run: bool) -> dict:
        """Delete now, or mark for deletion while finalizers remain."""
        if old["metadata"].get("deletionTimestamp"):
            return old
        new = copy.deepcopy(old)
        if key == NAMESPACES:
            new["metadata"]["deletionTimestamp"] = utcnow()
            new.setdefault("status", {})["phase"] = "Terminating"
            self._commit(key, "MODIFIED", new, old, dry_run)
            if not dry_run:
                name = new["metadata"]["name"]
                for (rkey, ns, _), obj in list(self.store.items()):
                    if ns == name:
                        self._remove(rkey, obj, False)
                self._finish_namespace(name)
            return new
        if old["metadata"].get("finalizers"):
            new["metadata"]["deletionTimestamp"] = utcnow()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            self._commit(key, "MODIFIED", new, old, dry_run)
            return new
        self._commit(key, "DELETED", new, old, dry_run)
        if key == CRD_KEY and not dry_run:
            self._uninstall_crd(new)
        return new

    def _finish_namespace(self, name: str) -> None:
        ns = self._by_resource[NAMESPACES].get((None, name))
        if ns is None or not ns["metadata"].get("deletionTimestamp"):
            return
        if not any(n == name for (_, n, _) in self.store):
            self._commit(NAMESPACES, "DELETED", copy.deepcopy(ns), ns, False)

    async def _delete_collection(self, call: Call) -> dict:
        listed = self._list(call)
        async with self._writes:
            deleted = [self._remove(call.key, o, call.dry_run) for o in listed["items"]]
        return {**listed, "items": deleted}

    def _check_type(self, call: Call, obj: dict) -> None:
        want_version, want_kind = _api_version(call.key), call.info.kind
        if obj.get("apiVersion") not in (None, want_version):
            raise ApiError(400, "BadRequest", f"the API version in the data ({obj['apiVersion']}) "
                                              f"does not match the expected API version "
                                              f"({want_version})")
        if obj.get("kind") not in (None, want_kind):
            raise ApiError(400, "BadRequest", f"the kind in the data ({obj['kind']}) does not "
                                              f"match the expected kind ({want_kind})")
        obj["apiVersion"], obj["kind"] = want_version, want_kind

    # -- admission: pruning, defaults, schema, rules ---------------------------------------------
    def _admit(self, call: Call, obj: dict, old: dict | None) -> list[str]:
        """Prune, default and validate `obj` in place; the warnings to send back."""
        unknown: list[str] = []
        meta = obj.get("metadata") or {}
        for field in sorted(set(meta) - OBJECT_META_FIELDS):
            unknown.append(f"metadata.{field}")
            del meta[field]
        crd = call.crd
        if crd is not None:
            for field in sorted(set(obj) - {"apiVersion", "kind", "metadata"}
                                - set(crd.schema.get("properties") or {})):
                if not crd.schema.get("x-kubernetes-preserve-unknown-fields"):
                    unknown.append(field)
                    del obj[field]
            for field, sub in (crd.schema.get("properties") or {}).items():
                if field not in ("apiVersion", "kind", "metadata") and field in obj:
                    obj[field] = _prune(obj[field], sub, field, unknown)
        mode = call.request.params.get("fieldValidation", "Warn")
        if mode not in FIELD_VALIDATION:
            raise ApiError(400, "BadRequest", f"fieldValidation must be one of "
                                              f"{', '.join(FIELD_VALIDATION)}, not {mode!r}")
        if unknown and mode == "Strict":
            words = ", ".join(f'unknown field "{f}"' for f in unknown)
            prefix = "" if call.request.method == "PATCH" else \
                f'{call.info.kind} in version "{call.key[1]}" cannot be handled as a ' \
                f"{call.info.kind}: "
            raise ApiError(400, "BadRequest", f"{prefix}strict decoding error: {words}")
        annotations = meta.get("annotations") or {}
        size = sum(len(str(k).encode()) + len(str(v).encode()) for k, v in annotations.items()) \
            if isinstance(annotations, dict) else 0
        if size > ANNOTATIONS_MAX_BYTES:
            raise self._invalid(call, obj, [_cause(
                "FieldValueTooLong", "metadata.annotations",
                f"Too long: may not be more than {ANNOTATIONS_MAX_BYTES} bytes")])
        if crd is None:
            return []
        _default(obj, crd.schema)
        causes = _validate(obj, crd.schema, "", old, root=True)
        if causes:
            raise self._invalid(call, obj, causes)
        return [f'unknown field "{f}"' for f in unknown] if mode == "Warn" else []

    def _invalid(self, call: Call, obj: dict, causes: list[dict]) -> ApiError:
        name = (obj.get("metadata") or {}).get("name") or call.name or ""
        listed = [f"{c['field']}: {c['message']}" for c in causes]
        words = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
        what = f"{call.info.kind}.{call.key[0]}" if call.key[0] else call.info.kind
        return ApiError(422, "Invalid", f'{what} "{name}" is invalid: {words}',
                        {"name": name, "group": call.key[0], "kind": call.info.kind,
                         "causes": causes})

    # -- CustomResourceDefinitions ---------------------------------------------------------------
    def _check_crd(self, crd: dict) -> None:
        """Refuse what a real server refuses, and rules this one could not enforce."""
        causes = []
        spec = crd.get("spec") or {}
        for i, version in enumerate(spec.get("versions") or []):
            schema = ((version.get("schema") or {}).get("openAPIV3Schema") or {})
            where = f"spec.versions[{i}].schema.openAPIV3Schema"
            meta = (schema.get("properties") or {}).get("metadata")
            if meta is not None:
                extra = set(meta) - {"type", "properties"}
                names = set(meta.get("properties") or {})
                if extra or names - {"name", "generateName"} or meta.get("type") != "object":
                    causes.append(_cause("FieldValueForbidden", f"{where}.properties[metadata]",
                                         "Forbidden: must not specify anything other than name "
                                         "and generateName, but metadata is implicitly "
                                         "specified"))
            for path, rule in _rules(schema, where):
                if rule.get("rule") not in SUPPORTED_RULES:
                    causes.append(_cause(
                        "FieldValueInvalid", f"{path}.x-kubernetes-validations",
                        f"Invalid value: {json.dumps(rule.get('rule'))}: the emulator evaluates "
                        f"only the rules {', '.join(SUPPORTED_RULES)}; add the form to "
                        "controller/kube/emulator.py or test against a real cluster"))
        if causes:
            name = (crd.get("metadata") or {}).get("name", "")
            raise ApiError(422, "Invalid", f'CustomResourceDefinition.apiextensions.k8s.io '
                                           f'"{name}" is invalid: '
                                           + ", ".join(f"{c['field']}: {c['message']}"
                                                       for c in causes),
                           {"name": name, "group": "apiextensions.k8s.io",
                            "kind": "CustomResourceDefinition", "causes": causes})

    def _install_crd(self, crd: dict) -> None:
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            if not version.get("served", True):
                continue
            key = (spec["group"], version["name"], names["plural"])
            subresources = list(version.get("subresources") or {})
            self.resources[f"{key[0]}/{key[1]}/{key[2]}"] = kmock.ResourceInfo(
                kind=names.get("kind"), singular=names.get("singular") or names["kind"].lower(),
                namespaced=spec.get("scope") == "Namespaced",
                verbs=["create", "delete", "deletecollection", "get", "list", "patch", "update",
                       "watch"],
                shortnames=names.get("shortNames") or [], categories=names.get("categories") or [],
                subresources=subresources)
            self._crds[key] = Crd(
                group=key[0], version=key[1], kind=names["kind"], plural=key[2],
                list_kind=names.get("listKind") or f"{names['kind']}List",
                namespaced=spec.get("scope") == "Namespaced",
                schema=(version.get("schema") or {}).get("openAPIV3Schema") or {},
                columns=version.get("additionalPrinterColumns") or [
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
                status_subresource="status" in subresources)
        self._schema_epoch += 1

    def _uninstall_crd(self, crd: dict) -> None:
        spec = crd.get("spec") or {}
        for version in spec.get("versions") or []:
            key = (spec["group"], version["name"], (spec.get("names") or {}).get("plural"))
            for obj in list(self._by_resource[key].values()):
                self._commit(key, "DELETED", copy.deepcopy(obj), obj, False)
            self._crds.pop(key, None)
            res = kmock.resource(*key)
            if res in self.resources:
                del self.resources[res]
        self._schema_epoch += 1

    # -- watch -----------------------------------------------------------------------------------
    async def _serve_watch(self, call: Call) -> aiohttp.web.StreamResponse:
        """Changes after the `resourceVersion` asked for, none lost, none repeated."""
        if call.name is not None:  # a watch of one object is a watch with a field selector
            selector = call.request.params.get("fieldSelector")
            extra = f"metadata.name={call.name}"
            call.request.params["fieldSelector"] = f"{selector},{extra}" if selector else extra
        labels = _label_selector(call.request.params.get("labelSelector", ""))
        fields = self._field_selector(call)

        def matches(obj: dict | None) -> bool:
            return obj is not None and \
                call.namespace in (None, obj["metadata"].get("namespace")) and \
                labels(obj) and fields(obj)

        table = _wants_table(call.header("Accept"))
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
                obj = self._table(call, [new], headers=first) if table else new
                first = False
                await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._watchers[call.key].discard(queue)
        return response

    # -- tables (kubectl get) --------------------------------------------------------------------
    def _table(self, call: Call, items: list[dict], list_meta: dict | None = None,
               headers: bool = True) -> dict:
        if call.crd is not None:
            columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                        "description": "Name must be unique within a namespace."}]
            columns += [{"name": c["name"], "type": c.get("type", "string"),
                         "format": c.get("format", ""), "priority": c.get("priority", 0),
                         "description": c.get("description", "")} for c in call.crd.columns]
            paths = [c["jsonPath"] for c in call.crd.columns]

            def cells(obj: dict) -> list:
                return [obj["metadata"]["name"]] + [
                    _cell(col["type"], _jsonpath(obj, p)) for col, p in zip(columns[1:], paths)]
        else:
            spec = BUILTIN_COLUMNS.get(call.key[2], DEFAULT_COLUMNS)
            columns = [{"name": n, "type": t, "format": "name" if n == "Name" else "",
                        "priority": p, "description": ""} for n, t, p, _ in spec]

            def cells(obj: dict) -> list:
                return [fn(obj) for _, _, _, fn in spec]
        include = call.request.params.get("includeObject", "Metadata")
        rows = []
        for obj in items:
            row: dict = {"cells": cells(obj)}
            if include == "Object":
                row["object"] = obj
            elif include != "None":
                row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                 "metadata": obj["metadata"]}
            rows.append(row)
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1",
                "metadata": list_meta or {"resourceVersion": str(self._revision)},
                "columnDefinitions": columns if headers else [], "rows": rows}

    # -- OpenAPI ---------------------------------------------------------------------------------
    def _openapi_v3(self) -> dict[str, tuple[str, dict]]:
        """One document per group-version, with its hash (clients cache by it)."""
        if self._openapi_cache is not None and self._openapi_cache[0] == self._schema_epoch:
            return self._openapi_cache[1]
        docs = {}
        for group, versions in self._groups().items():
            for version in versions:
                doc = self._openapi_doc(group, version)
                gv = f"api/{version}" if not group else f"apis/{group}/{version}"
                digest = hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest()
                docs[gv] = (digest[:32].upper(), doc)
        self._openapi_cache = (self._schema_epoch, docs)
        return docs

    def _openapi_doc(self, group: str, version: str) -> dict:
        paths, schemas = {}, {}
        for key, info in sorted(self._infos().items()):
            if key[:2] != (group, version):
                continue
            gvk = {"group": group, "version": version, "kind": info.kind}
            name = _schema_name(key, info.kind)
            crd = self._crds.get(key)
            ref = {"$ref": f"#/components/schemas/{name}"} if crd else None
            paths.update(_openapi_paths(key, info, gvk, ref))
            if crd is not None:
                schemas[name] = _published_schema(crd, gvk)
                schemas[f"{name}List"] = {
                    "type": "object", "description": f"A list of {crd.kind}.",
                    "required": ["items"],
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "items": {"type": "array", "items": ref},
                                   "metadata": {"type": "object"}},
                    "x-kubernetes-group-version-kind": [{**gvk, "kind": crd.list_kind}]}
        if schemas:
            schemas[OBJECT_META] = OBJECT_META_SCHEMA
        return {"openapi": "3.0.0",
                "info": {"title": "Kubernetes (autolab emulator)", "version": "v1.32.0"},
                "paths": paths, "components": {"schemas": schemas}}

    def _serve_openapi_v2(self, request: rendering.Request) -> aiohttp.web.Response:
        accept = request.headers.get("Accept", "*/*")
        if "json" not in accept and "*/*" not in accept:
            raise ApiError(406, "NotAcceptable", "the emulator serves /openapi/v2 as JSON only; "
                                                 "kubectl reads /openapi/v3")
        paths, definitions = {}, {}
        for _, (_, doc) in sorted(self._openapi_v3().items()):
            for path, item in doc["paths"].items():
                paths[path] = {m: {k: v for k, v in op.items() if k != "responses"}
                               | {"responses": {"200": {"description": "OK"}}}
                               for m, op in item.items() if m != "parameters"}
            for name, schema in doc["components"]["schemas"].items():
                definitions[name] = _to_v2(schema)
        return _json({"swagger": "2.0", "info": {"title": "Kubernetes (autolab emulator)",
                                                 "version": "v1.32.0"},
                      "paths": paths, "definitions": definitions})

    # -- conveniences for tests: read objects as the cluster would --------------------------------
    @property
    def requests(self) -> list[rendering.Request]:
        """Every request served so far, oldest first."""
        return list(self._requests)

    def get(self, resource: str, namespace: str | None, name: str) -> dict | None:
        r = kmock.resource(resource)
        obj = self._by_resource[(r.group, r.version, r.plural)].get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def items(self, resource: str, namespace: str | None = None) -> list[dict]:
        r = kmock.resource(resource)
        return [copy.deepcopy(o) for (ns, _), o in self._by_resource[(r.group, r.version,
                                                                       r.plural)].items()
                if namespace is None or ns == namespace]


# ------------------------------------------------------------------------------------------------
# Paths, selectors, patches
# ------------------------------------------------------------------------------------------------

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


def _api_version(key: Key) -> str:
    return f"{key[0]}/{key[1]}" if key[0] else key[1]


def _qualified(key: Key) -> str:
    return f"{key[2]}.{key[0]}" if key[0] else key[2]


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


_LABEL_TERM = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*"
                         r"\(([^)]*)\))?\s*$")


def _label_selector(selector: str) -> Callable[[dict], bool]:
    """A label selector (`a=b`, `a!=b`, `a in (x,y)`, `a notin (x)`, `a`, `!a`) as a test."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(selector + ","):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if selector[start:i].strip():
                terms.append(selector[start:i])
            start = i + 1
    parsed = []
    for term in terms:
        m = _LABEL_TERM.match(term)
        if m is None:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {term!r} is not a "
                                              "label selector term")
        neg, key, op, value, setop, values = m.groups()
        parsed.append((neg, key, op, value,
                       setop, {v.strip() for v in (values or "").split(",") if v.strip()}))

    def matches(obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        for neg, key, op, value, setop, values in parsed:
            have = labels.get(key)
            ok = (have == value if op in ("=", "==") else have != value if op == "!="
                  else have in values if setop == "in" else have not in values if setop == "notin"
                  else have is not None)
            if ok == bool(neg):
                return False
        return True
    return matches


def _parse_field_selector(selector: str) -> list[tuple[str, str, str]]:
    """`a=b,c!=d` with `\\,` `\\=` escapes, as [(field, '=' or '!=', value)]."""
    terms, current, escaped = [], "", False
    for ch in selector + ",":
        if escaped:
            current += "\\" + ch
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == ",":
            if current.strip():
                terms.append(current)
            current = ""
        else:
            current += ch
    out = []
    for term in terms:
        m = re.match(r"^([^=!]+)(==|=|!=)(.*)$", term)
        if m is None:
            raise ApiError(400, "BadRequest", f"invalid selector: {term!r}; only 'key=value' and "
                                              "'key!=value' are supported")
        value = re.sub(r"\\(.)", r"\1", m.group(3))
        out.append((m.group(1).strip(), "!=" if m.group(2) == "!=" else "=", value))
    return out


FIELD_LABELS = {
    "events": {"involvedObject.kind", "involvedObject.namespace", "involvedObject.name",
               "involvedObject.uid", "involvedObject.apiVersion", "involvedObject.resourceVersion",
               "involvedObject.fieldPath", "reason", "reportingComponent", "source", "type"},
    "pods": {"spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
             "spec.serviceAccountName", "status.phase", "status.podIP", "status.nominatedNodeName"},
    "secrets": {"type"},
    "namespaces": {"status.phase"},
    "jobs": {"status.successful"},
}


def _field_value(obj: dict, field: str) -> str:
    if field == "source":
        value: Any = (obj.get("source") or {}).get("component")
    else:
        value = obj
        for part in field.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge_patch(out.get(k), v)
    return out


def _strategic_merge(target: Any, patch: Any) -> Any:
    """The strategic merge patch of the built-in kinds, for the lists they merge by a key.

    Directives kubectl sends (`$setElementOrder/...`, `$retainKeys`) are read as hints and
    dropped; `$patch: delete|replace` and `$deleteFromPrimitiveList/...` are honoured.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if k.startswith("$deleteFromPrimitiveList/"):
            field = k.split("/", 1)[1]
            out[field] = [x for x in out.get(field) or [] if x not in v]
        elif k.startswith("$"):
            continue
        elif v is None:
            out.pop(k, None)
        elif isinstance(v, list) and k in MERGE_KEYS and all(isinstance(x, dict) for x in v) \
                and isinstance(out.get(k), list):
            out[k] = _merge_list(out[k], v, MERGE_KEYS[k])
        else:
            out[k] = _strategic_merge(out.get(k), v)
    return out


def _merge_list(old: list, patch: list, key: str) -> list:
    out = [copy.deepcopy(x) for x in old]
    for item in patch:
        at = next((i for i, x in enumerate(out) if isinstance(x, dict)
                   and x.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if at is not None:
                del out[at]
        elif at is None:
            out.append(_strategic_merge({}, item))
        else:
            out[at] = _strategic_merge(out[at], item)
    return out


# ------------------------------------------------------------------------------------------------
# Schemas: pruning, defaults, validation, rules
# ------------------------------------------------------------------------------------------------

def _prune(value: Any, schema: dict, path: str, unknown: list[str]) -> Any:
    """Drop fields the schema does not know (recording their paths), as the API server does."""
    if isinstance(value, dict) and schema.get("type", "object") == "object":
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        keep = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
        for k in list(value):
            sub = props.get(k, extra if isinstance(extra, dict) else None)
            if sub is not None:
                value[k] = _prune(value[k], sub, f"{path}.{k}", unknown)
            elif not keep:
                unknown.append(f"{path}.{k}")
                del value[k]
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(v, schema["items"], f"{path}[{i}]", unknown) for i, v in enumerate(value)]
    return value


def _default(value: Any, schema: dict) -> None:
    """Fill in `default`s where an object lacks the field."""
    if isinstance(value, dict):
        for k, sub in (schema.get("properties") or {}).items():
            if k not in value and "default" in sub:
                value[k] = copy.deepcopy(sub["default"])
            if k in value:
                _default(value[k], sub)
        if isinstance(schema.get("additionalProperties"), dict):
            for v in value.values():
                _default(v, schema["additionalProperties"])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for v in value:
            _default(v, schema["items"])


_MISSING = object()


def _validate(value: Any, schema: dict, path: str, old: Any, root: bool = False) -> list[dict]:
    """The causes of a 422, each worded as the API server words it; [] when valid."""
    where = path or "<root>"
    if value is None:
        if schema.get("nullable") or not schema.get("type"):
            return []
        return [_cause("FieldValueTypeInvalid", where,
                       f'Invalid value: "null": {where} in body must be of type '
                       f'{schema["type"]}: "null"')]
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        kind = None if isinstance(value, (int, str)) and not isinstance(value, bool) else "string"
    if kind and not _is_type(value, kind):
        return [_cause("FieldValueTypeInvalid", where,
                       f'Invalid value: "{_type_name(value)}": {where} in body must be of type '
                       f'{kind}: "{_type_name(value)}"')]
    causes: list[dict] = []
    if "enum" in schema and value not in schema["enum"]:
        causes.append(_cause("FieldValueNotSupported", where,
                             f"Unsupported value: {_shown(value)}: supported values: "
                             + ", ".join(_shown(v) for v in schema["enum"])))
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            causes.append(_cause("FieldValueTooLong", where,
                                 f"Too long: may not be more than {schema['maxLength']} bytes"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            causes.append(_cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should be at "
                                 f"least {schema['minLength']} chars long"))
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            causes.append(_cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should match "
                                 f"'{schema['pattern']}'"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "maximum" in schema and (value > schema["maximum"] or (
                schema.get("exclusiveMaximum") and value == schema["maximum"])):
            causes.append(_cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should be less "
                                 f"than {'' if schema.get('exclusiveMaximum') else 'or equal to '}"
                                 f"{schema['maximum']}"))
        if "minimum" in schema and (value < schema["minimum"] or (
                schema.get("exclusiveMinimum") and value == schema["minimum"])):
            causes.append(_cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should be "
                                 f"greater than {'' if schema.get('exclusiveMinimum') else 'or '}"
                                 f"{'' if schema.get('exclusiveMinimum') else 'equal to '}"
                                 f"{schema['minimum']}"))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append(_cause("FieldValueTooMany", where, f"Too many: {len(value)}: must have "
                                                             f"at most {schema['maxItems']} items"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            causes.append(_cause("FieldValueInvalid", where,
                                 f"Invalid value: {len(value)}: {where} in body should have at "
                                 f"least {schema['minItems']} items"))
        if isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                causes += _validate(v, schema["items"], f"{path}[{i}]", _MISSING)
    if isinstance(value, dict):
        for k in schema.get("required") or []:
            if k not in value:
                causes.append(_cause("FieldValueRequired", f"{path}.{k}".lstrip("."),
                                     "Required value"))
        for k, v in value.items():
            sub = (schema.get("properties") or {}).get(k)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None and not (root and k == "metadata" and "properties" not in sub):
                was = old.get(k, _MISSING) if isinstance(old, dict) else _MISSING
                causes += _validate(v, sub, f"{path}.{k}".lstrip("."), was)
    for rule in schema.get("x-kubernetes-validations") or []:
        if old is _MISSING or old is None:
            continue  # a transition rule: only for an update of a value that was there
        if rule.get("rule") == "self == oldSelf" and value != old:
            causes.append(_cause("FieldValueInvalid", where,
                                 f'Invalid value: "{_type_name(value)}": '
                                 f'{rule.get("message") or "failed rule: self == oldSelf"}'))
    return causes


def _rules(schema: dict, path: str) -> Iterable[tuple[str, dict]]:
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule
    for k, sub in (schema.get("properties") or {}).items():
        yield from _rules(sub, f"{path}.properties[{k}]")
    for k in ("items", "additionalProperties"):
        if isinstance(schema.get(k), dict):
            yield from _rules(schema[k], f"{path}.{k}")


def _is_type(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    return {"object": isinstance(value, dict), "array": isinstance(value, list),
            "string": isinstance(value, str), "integer": isinstance(value, int),
            "number": isinstance(value, (int, float)), "boolean": False}.get(kind, True)


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "integer",
            float: "number"}.get(type(value), "null")


def _shown(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else \
        str(value).lower() if isinstance(value, bool) else str(value)


def _cause(reason: str, field: str, message: str) -> dict:
    return {"reason": reason, "message": message, "field": field}


def _secret_defaults(secret: dict) -> None:
    """A Secret's `stringData` goes into `data` (base64), and its type defaults to Opaque."""
    import base64

    for k, v in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[k] = base64.b64encode(str(v).encode()).decode()
    secret["type"] = secret.get("type") or "Opaque"


def _crd_status(crd: dict) -> dict:
    spec = crd.get("spec") or {}
    now = utcnow()
    return {"acceptedNames": spec.get("names") or {},
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": now}]}


# ------------------------------------------------------------------------------------------------
# Tables: printer columns and the built-in kinds' columns
# ------------------------------------------------------------------------------------------------

_JSONPATH_STEP = re.compile(r"\.([\w-]+)|\[(\d+)\]|\['([^']+)'\]|"
                            r"\[\?\(@\.([\w.]+)\s*==\s*[\"']([^\"']*)[\"']\)\]")


def _jsonpath(obj: Any, path: str) -> Any:
    """The value at a printer column's simple JSONPath (`.a.b`, `[0]`, `[?(@.k=="v")]`)."""
    path = path.strip()
    if path.startswith("{") and path.endswith("}"):
        path = path[1:-1]
    value, at = obj, 0
    while at < len(path):
        m = _JSONPATH_STEP.match(path, at)
        if m is None:
            return None
        at = m.end()
        key, index, quoted, fkey, fvalue = m.groups()
        if key is not None or quoted is not None:
            value = value.get(key or quoted) if isinstance(value, dict) else None
        elif index is not None:
            value = value[int(index)] if isinstance(value, list) and int(index) < len(value) \
                else None
        else:
            value = next((x for x in value or [] if isinstance(x, dict)
                          and str(_jsonpath(x, "." + fkey)) == fvalue), None) \
                if isinstance(value, list) else None
        if value is None:
            return None
    return value


def _cell(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "integer":
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
            else None
    if kind == "number":
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if kind == "date":
        return _age(value) if isinstance(value, str) else None
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _age(timestamp: str | None) -> str:
    """How long ago, as kubectl prints ages (`42s`, `5m3s`, `3h10m`, `4d`)."""
    if not timestamp:
        return "<unknown>"
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return "<invalid>"
    now = datetime.datetime.now(datetime.timezone.utc)
    seconds = int((now - then).total_seconds())
    if seconds < -1:
        return "<invalid>"
    if seconds < 120:
        return f"{max(seconds, 0)}s"
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 192:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    if days < 730:
        return f"{days}d"
    years = days // 365
    return f"{years}y{days % 365}d" if days % 365 and days < 2920 else f"{years}y"


def _meta(obj: dict, field: str) -> Any:
    return (obj.get("metadata") or {}).get(field)


def _pod_status(pod: dict) -> str:
    st = pod.get("status") or {}
    if _meta(pod, "deletionTimestamp"):
        return "Terminating"
    for c in reversed(st.get("containerStatuses") or []):
        state = c.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            return state["waiting"]["reason"]
        if (state.get("terminated") or {}).get("reason") and st.get("phase") != "Running":
            return state["terminated"]["reason"]
    return st.get("reason") or st.get("phase") or "Pending"


def _job_status(job: dict) -> str:
    conditions = {c.get("type"): c.get("status") for c in
                  (job.get("status") or {}).get("conditions") or []}
    for kind in ("Complete", "Failed", "FailureTarget", "SuccessCriteriaMet", "Suspended"):
        if conditions.get(kind) == "True":
            return kind
    return "Running"


def _job_duration(job: dict) -> str:
    st = job.get("status") or {}
    if not st.get("startTime"):
        return ""
    if not st.get("completionTime"):
        return _age(st["startTime"])
    start = datetime.datetime.fromisoformat(st["startTime"].replace("Z", "+00:00"))
    end = datetime.datetime.fromisoformat(st["completionTime"].replace("Z", "+00:00"))
    return _age((datetime.datetime.now(datetime.timezone.utc) - (end - start)).isoformat())


def _event_object(ev: dict) -> str:
    ref = ev.get("involvedObject") or {}
    return f"{str(ref.get('kind', '')).lower()}/{ref.get('name', '')}"


def _name(obj: dict) -> str:
    return _meta(obj, "name")


def _created(obj: dict) -> str:
    return _age(_meta(obj, "creationTimestamp"))


DEFAULT_COLUMNS = [("Name", "string", 0, _name), ("Age", "string", 0, _created)]
BUILTIN_COLUMNS: dict[str, list[tuple[str, str, int, Callable[[dict], Any]]]] = {
    "namespaces": [("Name", "string", 0, _name),
                   ("Status", "string", 0, lambda o: (o.get("status") or {}).get("phase", "")),
                   ("Age", "string", 0, _created)],
    "configmaps": [("Name", "string", 0, _name),
                   ("Data", "integer", 0, lambda o: len(o.get("data") or {})
                    + len(o.get("binaryData") or {})),
                   ("Age", "string", 0, _created)],
    "secrets": [("Name", "string", 0, _name), ("Type", "string", 0, lambda o: o.get("type", "")),
                ("Data", "integer", 0, lambda o: len(o.get("data") or {})),
                ("Age", "string", 0, _created)],
    "pods": [("Name", "string", 0, _name),
             ("Ready", "string", 0, lambda o: "{}/{}".format(
                 sum(1 for c in (o.get("status") or {}).get("containerStatuses") or []
                     if c.get("ready")), len((o.get("spec") or {}).get("containers") or []))),
             ("Status", "string", 0, _pod_status),
             ("Restarts", "string", 0, lambda o: str(sum(
                 c.get("restartCount", 0) for c in
                 (o.get("status") or {}).get("containerStatuses") or []))),
             ("Age", "string", 0, _created),
             ("IP", "string", 1, lambda o: (o.get("status") or {}).get("podIP") or "<none>"),
             ("Node", "string", 1, lambda o: (o.get("spec") or {}).get("nodeName") or "<none>")],
    "jobs": [("Name", "string", 0, _name), ("Status", "string", 0, _job_status),
             ("Completions", "string", 0, lambda o: "{}/{}".format(
                 (o.get("status") or {}).get("succeeded", 0),
                 (o.get("spec") or {}).get("completions", 1))),
             ("Duration", "string", 0, _job_duration), ("Age", "string", 0, _created),
             ("Containers", "string", 1, lambda o: ",".join(
                 c.get("name", "") for c in ((((o.get("spec") or {}).get("template") or {})
                                              .get("spec") or {}).get("containers") or []))),
             ("Images", "string", 1, lambda o: ",".join(
                 c.get("image", "") for c in ((((o.get("spec") or {}).get("template") or {})
                                               .get("spec") or {}).get("containers") or [])))],
    "events": [("Last Seen", "string", 0, lambda e: _age(
                   e.get("lastTimestamp") or e.get("eventTime") or _meta(e, "creationTimestamp"))),
               ("Type", "string", 0, lambda e: e.get("type", "")),
               ("Reason", "string", 0, lambda e: e.get("reason", "")),
               ("Object", "string", 0, _event_object),
               ("Message", "string", 0, lambda e: e.get("message", ""))],
    "customresourcedefinitions": [("Name", "string", 0, _name),
                                  ("Created At", "date", 0,
                                   lambda o: _meta(o, "creationTimestamp"))],
}


# ------------------------------------------------------------------------------------------------
# OpenAPI documents
# ------------------------------------------------------------------------------------------------

OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
OBJECT_META_SCHEMA = {
    "type": "object",
    "description": "Metadata every persisted object has: its name, where it lives, its labels "
                   "and what the server records about it.",
    "properties": {
        "name": {"type": "string", "description": "Unique within a namespace; cannot change."},
        "generateName": {"type": "string", "description": "A prefix the server completes into "
                                                          "a unique name when name is empty."},
        "namespace": {"type": "string", "description": "The namespace the object lives in."},
        "labels": {"type": "object", "additionalProperties": {"type": "string"},
                   "description": "Key/value pairs selectors match on."},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"},
                        "description": "Key/value pairs for tools; not queryable."},
        "uid": {"type": "string", "description": "Set by the server; unique in time and space."},
        "resourceVersion": {"type": "string", "description": "Changes on every write; name it "
                                                             "in an update to make it "
                                                             "conditional."},
        "generation": {"type": "integer", "format": "int64",
                       "description": "Counts changes to the desired state."},
        "creationTimestamp": {"type": "string", "format": "date-time",
                              "description": "When the server created the object."},
        "deletionTimestamp": {"type": "string", "format": "date-time",
                              "description": "Set when deletion was asked for; the object goes "
                                             "once its finalizers are gone."},
        "deletionGracePeriodSeconds": {"type": "integer", "format": "int64",
                                       "description": "Seconds allowed for a graceful delete."},
        "finalizers": {"type": "array", "items": {"type": "string"},
                       "description": "What must happen before the object is removed."},
        "ownerReferences": {"type": "array", "description": "The objects this one belongs to.",
                            "items": {"type": "object",
                                      "x-kubernetes-preserve-unknown-fields": True}},
        "managedFields": {"type": "array", "description": "Which manager owns which fields.",
                          "items": {"type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True}},
    },
}


def _schema_name(key: Key, kind: str) -> str:
    group = ".".join(reversed(key[0].split("."))) if key[0] else "io.k8s.api.core"
    return f"{group}.{key[1]}.{kind}"


def _published_schema(crd: Crd, gvk: dict) -> dict:
    """The CRD's schema as the server publishes it: standard apiVersion/kind/metadata fields."""
    schema = copy.deepcopy(crd.schema)
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"type": "string", "description": props.get("apiVersion", {}).get(
        "description") or "The versioned schema of this representation of an object."}
    props["kind"] = {"type": "string", "description": props.get("kind", {}).get(
        "description") or "The REST resource this object represents."}
    props["metadata"] = {"allOf": [{"$ref": f"#/components/schemas/{OBJECT_META}"}],
                         "description": "Standard object's metadata."}
    schema["x-kubernetes-group-version-kind"] = [gvk]
    return schema


def _openapi_paths(key: Key, info: Any, gvk: dict, ref: dict | None) -> dict:
    """The operations on one resource, each saying its kind and its parameters."""
    prefix = f"/api/{key[1]}" if not key[0] else f"/apis/{key[0]}/{key[1]}"
    scoped = f"{prefix}/namespaces/{{namespace}}/{key[2]}" if info.namespaced \
        else f"{prefix}/{key[2]}"

    def op(action: str, writes: bool = False) -> dict:
        params = [{"name": "dryRun", "in": "query", "schema": {"type": "string"}},
                  {"name": "fieldManager", "in": "query", "schema": {"type": "string"}},
                  {"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}] \
            if writes else []
        content = {"application/json": {"schema": ref}} if ref else {}
        return {"operationId": f"{action}{gvk['kind']}", "parameters": params,
                "responses": {"200": {"description": "OK", "content": content}},
                "x-kubernetes-action": action, "x-kubernetes-group-version-kind": gvk}

    verbs = set(info.verbs)
    one = {m: op(a, w) for m, a, w, v in (("get", "get", False, "get"),
                                          ("put", "put", True, "update"),
                                          ("patch", "patch", True, "patch"),
                                          ("delete", "delete", False, "delete")) if v in verbs}
    many = {m: op(a, w) for m, a, w, v in (("get", "list", False, "list"),
                                           ("post", "post", True, "create"))
            if v in verbs}
    paths = {scoped: many, f"{scoped}/{{name}}": one}
    if "status" in info.subresources:
        paths[f"{scoped}/{{name}}/status"] = {m: op(a, w) for m, a, w in (
            ("get", "get", False), ("put", "put", True), ("patch", "patch", True))}
    return {p: item for p, item in paths.items() if item}


def _to_v2(schema: Any) -> Any:
    """OpenAPI v3 schema to v2: no `nullable`, references to #/definitions."""
    if isinstance(schema, dict):
        out = {}
        for k, v in schema.items():
            if k == "nullable":
                continue
            if k == "$ref":
                out[k] = v.replace("#/components/schemas/", "#/definitions/")
            else:
                out[k] = _to_v2(v)
        return out
    if isinstance(schema, list):
        return [_to_v2(v) for v in schema]
    return schema


# ------------------------------------------------------------------------------------------------
# Protobuf: the few kinds kubectl's typed clients send that way (create namespace/configmap/secret)
# ------------------------------------------------------------------------------------------------

# field number -> (JSON name, how to read it); a dict is a nested message
_STRING_MAP = "map"
_BYTES_MAP = "map-bytes"
_PB_META = {1: ("name", "string"), 2: ("generateName", "string"), 3: ("namespace", "string"),
            5: ("uid", "string"), 6: ("resourceVersion", "string"), 7: ("generation", "int"),
            11: ("labels", _STRING_MAP), 12: ("annotations", _STRING_MAP),
            14: ("finalizers", "strings")}
_PB_KINDS = {
    "Namespace": {1: ("metadata", _PB_META), 2: ("spec", {1: ("finalizers", "strings")})},
    "ConfigMap": {1: ("metadata", _PB_META), 2: ("data", _STRING_MAP),
                  3: ("binaryData", _BYTES_MAP), 4: ("immutable", "bool")},
    "Secret": {1: ("metadata", _PB_META), 2: ("data", _BYTES_MAP), 3: ("type", "string"),
               4: ("stringData", _STRING_MAP), 5: ("immutable", "bool")},
}


def _pb_fields(buf: bytes) -> list[tuple[int, Any]]:
    """The (field number, value) pairs of a protobuf message: varints as ints, the rest bytes."""
    out, at = [], 0

    def varint() -> int:
        nonlocal at
        value, shift = 0, 0
        while True:
            b = buf[at]
            at += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value
    while at < len(buf):
        tag = varint()
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            out.append((number, varint()))
        elif wire == 2:
            size = varint()
            out.append((number, buf[at:at + size]))
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ApiError(400, "BadRequest", "the protobuf body could not be read")
    return out


def _pb_message(buf: bytes, schema: dict) -> dict:
    import base64

    out: dict = {}
    for number, value in _pb_fields(buf):
        if number not in schema:
            continue
        name, how = schema[number]
        if isinstance(how, dict):
            out[name] = _pb_message(value, how)
        elif how in (_STRING_MAP, _BYTES_MAP):
            entry = dict(_pb_fields(value))
            v = entry.get(2, b"")
            out.setdefault(name, {})[entry.get(1, b"").decode()] = \
                base64.b64encode(v).decode() if how == _BYTES_MAP else v.decode()
        elif how == "strings":
            out.setdefault(name, []).append(value.decode())
        elif how == "string" and value:  # proto2 sends empty strings; JSON omits them
            out[name] = value.decode()
        elif how == "int":
            out[name] = value
        elif how == "bool":
            out[name] = bool(value)
    return out


def _from_protobuf(body: bytes) -> dict:
    """A Kubernetes protobuf envelope (`k8s\\0` + runtime.Unknown) as the JSON object it holds."""
    if not body.startswith(b"k8s\x00"):
        raise ApiError(400, "BadRequest", "the protobuf body lacks the Kubernetes envelope")
    unknown = dict(_pb_fields(body[4:]))
    type_meta = dict(_pb_fields(unknown.get(1, b"")))
    api_version, kind = type_meta.get(1, b"").decode(), type_meta.get(2, b"").decode()
    if kind not in _PB_KINDS:
        raise ApiError(415, "UnsupportedMediaType",
                       f"the emulator reads protobuf only for {', '.join(_PB_KINDS)}, not "
                       f"{kind or 'this kind'}; send application/json")
    return {"apiVersion": api_version, "kind": kind,
            **_pb_message(unknown.get(2, b""), _PB_KINDS[kind])}


# ------------------------------------------------------------------------------------------------
# HTTP helpers
# ------------------------------------------------------------------------------------------------

def _wants_table(accept: str) -> bool:
    for media in accept.split(","):
        params = dict(p.strip().partition("=")[::2] for p in media.split(";")[1:])
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io":
            return True
    return False


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
