"""The storage layer: the objects, their versions, and every write.

`Store` holds every object by resource, namespace and name, and a cluster-wide
`resourceVersion` counter that moves on each write that changes something (a no-op write stores
nothing and wakes no watch). Each stored change goes through `_commit`, which appends it to the
event log the watch layer reads (`EVENT_LOG_SIZE` events, for clients that resume from a
version) and hands it to the open watches.

The writes keep a real server's rules: optimistic concurrency (a stale
`metadata.resourceVersion` is 409 Conflict), the status subresource (writes to the object keep
`.status`, writes to `/status` keep the rest), `generation` moving only when the desired state
changes, finalizers (a delete marks `deletionTimestamp`; the write that removes the last one
removes the object), namespaces that delete what is in them, and CRDs whose creation adds a
resource to the catalogue (and whose deletion removes it with its objects). Admission
(`admission`) runs on every create and update.

It is a mixin of `Emulator` (`server`), which creates its state with `_init_store()`; it
answers in objects and `ApiError`s, never in HTTP.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import secrets
import uuid
from typing import Any

import jsonpatch
import kmock

from controller.kube.emulator.admission import (admit, cause, check_crd, check_type,
                                                 crd_status, invalid, secret_defaults)
from controller.kube.emulator.model import (CRD_KEY, NAMESPACES, SECRETS, ApiError, Call, Crd,
                                             Key, ObjKey, api_version, qualified)
from controller.kube.emulator.patches import merge_patch, strategic_merge
from controller.kube.emulator.selectors import field_selector, label_selector
from controller.lab.clock import utcnow

EVENT_LOG_SIZE = 20_000        # watch events kept for clients resuming from a resourceVersion
SERVER_META_FIELDS = ("uid", "creationTimestamp", "generation", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "resourceVersion")


class Store:
    """The objects of one emulated cluster, and the writes that change them."""

    def _init_store(self) -> None:
        self.store: dict[ObjKey, dict] = {}
        self._by_resource: dict[Key, dict[tuple[str | None, str], dict]] = \
            collections.defaultdict(dict)
        self._crds: dict[Key, Crd] = {}
        self._revision = 0
        self._log: collections.deque = collections.deque(maxlen=EVENT_LOG_SIZE)
        self._log_floor = 0    # the newest resourceVersion no longer in the log
        self._watchers: dict[Key, set[asyncio.Queue]] = collections.defaultdict(set)
        self._writes = asyncio.Lock()
        self._schema_epoch = 0  # moves when a CRD changes what is served

    # -- reading ---------------------------------------------------------------------------------
    def _fetch(self, call: Call) -> dict:
        obj = self._by_resource[call.key].get((call.namespace, call.name or ""))
        if obj is None:
            raise self._not_found(call)
        return obj

    def _list(self, call: Call) -> dict:
        labels = label_selector(call.request.params.get("labelSelector", ""))
        fields = field_selector(call)
        items = [o for (ns, _), o in sorted(self._by_resource[call.key].items(),
                                            key=lambda kv: (kv[0][0] or "", kv[0][1]))
                 if call.namespace in (None, ns) and labels(o) and fields(o)]
        return {"apiVersion": api_version(call.key), "kind": self._list_kind(call),
                "metadata": {"resourceVersion": str(self._revision)}, "items": items}

    def _list_kind(self, call: Call) -> str:
        if call.crd is not None:
            return call.crd.list_kind
        return f"{call.info.kind}List"

    def _not_found(self, call: Call) -> ApiError:
        what = qualified(call.key)
        return ApiError(404, "NotFound", f'{what} "{call.name}" not found',
                        {"name": call.name, "group": call.key[0], "kind": call.key[2]})

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
            check_type(call, obj)
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
                raise invalid(call, obj, [cause("FieldValueRequired", "metadata.name",
                                                       "Required value: name or generateName "
                                                       "is required")])
            if (call.namespace, call.name) in self._by_resource[call.key]:
                raise ApiError(409, "AlreadyExists",
                               f'{qualified(call.key)} "{call.name}" already exists',
                               {"name": call.name, "group": call.key[0], "kind": call.key[2]})
            for field in SERVER_META_FIELDS:
                meta.pop(field, None)
            if call.crd is not None and call.crd.status_subresource:
                obj.pop("status", None)  # status is the controller's, written through /status
            warns = admit(call, obj, None)
            meta.update(uid=str(uuid.uuid4()), creationTimestamp=utcnow(), generation=1)
            if call.key == NAMESPACES:
                obj["status"] = {"phase": "Active"}
            if call.key == SECRETS:
                secret_defaults(obj)
            if call.key == CRD_KEY:
                check_crd(obj)
                obj["status"] = crd_status(obj)
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
                check_type(call, new)
                named = (new.get("metadata") or {}).get("name")
                if named not in (None, call.name):
                    raise ApiError(400, "BadRequest", f"the name of the object ({named}) does not "
                                                      f"match the name on the URL ({call.name})")
                if call.crd is not None and not (new.get("metadata") or {}).get("resourceVersion"):
                    raise invalid(call, new, [cause(
                        "FieldValueInvalid", "metadata.resourceVersion",
                        "Invalid value: 0x0: must be specified for an update")])
            if not isinstance(new, dict) or not isinstance(new.get("metadata", {}), dict):
                raise ApiError(422, "Invalid", "the patched object is not a Kubernetes object")
            wanted = (new.get("metadata") or {}).get("resourceVersion")
            if wanted not in (None, "") and str(wanted) != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict",
                               f'Operation cannot be fulfilled on {qualified(call.key)} '
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
            return merge_patch(old, body)
        if ctype == "application/strategic-merge-patch+json" and call.crd is None:
            return strategic_merge(old, body)
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
            raise invalid(call, new, [cause(
                "FieldValueForbidden", "metadata.finalizers",
                "Forbidden: no new finalizers can be added if the object is being deleted")])
        warns = admit(call, new, old)
        if call.key == SECRETS:
            secret_defaults(new)
        if self._spec_changed(call, old, new):
            meta["generation"] = int(was.get("generation", 1)) + 1
        if call.key == CRD_KEY:
            check_crd(new)
            new["status"] = crd_status(new)
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


    # -- CustomResourceDefinitions: what creating or deleting one serves ------------------------
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

    # -- conveniences for tests: read objects as the cluster would --------------------------------
    def get(self, resource: str, namespace: str | None, name: str) -> dict | None:
        r = kmock.resource(resource)
        obj = self._by_resource[(r.group, r.version, r.plural)].get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def items(self, resource: str, namespace: str | None = None) -> list[dict]:
        r = kmock.resource(resource)
        return [copy.deepcopy(o) for (ns, _), o in self._by_resource[(r.group, r.version,
                                                                       r.plural)].items()
                if namespace is None or ns == namespace]
