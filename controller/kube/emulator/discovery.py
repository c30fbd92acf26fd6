"""Discovery: what the server says it serves.

`/api` and `/apis` list the groups and versions, `/api/v1` and `/apis/G/V` their resources (the
built-in kinds of kmock's catalogue and the CRDs the store installed), and OpenAPI describes
them: `/openapi/v3` with one document per group-version, hashed as clients cache them, and
`/openapi/v2` (JSON), built from the CRDs' schemas, so `kubectl apply` validates on the server
and `kubectl explain` reads the descriptions. Answers are cached until a CRD changes what is
served (`_schema_epoch`). A mixin of `Emulator` (`server`); the HTTP layer wraps its documents
in responses.
"""

from __future__ import annotations

import collections
import copy
import hashlib
import json
from typing import Any

from controller.kube.emulator.model import ApiError, Crd, Key


class Discovery:
    """The discovery documents and OpenAPI of what the catalogue serves."""

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

    def _openapi_v2(self) -> dict:
        """The v3 documents as one Swagger 2.0 document."""
        paths, definitions = {}, {}
        for _, (_, doc) in sorted(self._openapi_v3().items()):
            for path, item in doc["paths"].items():
                paths[path] = {m: {k: v for k, v in op.items() if k != "responses"}
                               | {"responses": {"200": {"description": "OK"}}}
                               for m, op in item.items() if m != "parameters"}
            for name, schema in doc["components"]["schemas"].items():
                definitions[name] = _to_v2(schema)
        return {"swagger": "2.0", "info": {"title": "Kubernetes (autolab emulator)",
                                           "version": "v1.32.0"},
                "paths": paths, "definitions": definitions}


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
