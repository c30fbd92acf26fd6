"""Admission: what the server does to an object before the store keeps it.

A custom resource is admitted as a real server admits it: fields its schema does not know are
pruned and reported per `fieldValidation` (Strict refuses, Warn warns, Ignore is silent);
`default`s are filled in; the openAPIV3Schema is enforced (types, enum, pattern, lengths, bounds,
required), and so are the `x-kubernetes-validations` rules this emulator evaluates
(`SUPPORTED_RULES`; a CRD with another rule is refused when it is created). Every kind's
annotations are held to 256 KiB. Refusals are the 422 Invalid with the causes kubectl prints.

Also here: the defaults a Secret gets and the status a CRD gets. Pure functions over the object
and the request (`Call`); the store calls them.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable
from typing import Any

from controller.kube.emulator.model import ApiError, Call, api_version
from controller.lab.clock import utcnow

SUPPORTED_RULES = ("self == oldSelf",)
OBJECT_META_FIELDS = {"name", "generateName", "namespace", "selfLink", "uid", "resourceVersion",
                      "generation", "creationTimestamp", "deletionTimestamp",
                      "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences",
                      "finalizers", "managedFields"}
FIELD_VALIDATION = ("Ignore", "Warn", "Strict")
# An object's annotations may hold this many bytes in all, keys and values (apimachinery's
# TotalAnnotationSizeLimitB), on every kind: a write past it is 422 Invalid.
ANNOTATIONS_MAX_BYTES = 256 * 1024


def check_type(call: Call, obj: dict) -> None:
    want_version, want_kind = api_version(call.key), call.info.kind
    if obj.get("apiVersion") not in (None, want_version):
        raise ApiError(400, "BadRequest", f"the API version in the data ({obj['apiVersion']}) "
                                          f"does not match the expected API version "
                                          f"({want_version})")
    if obj.get("kind") not in (None, want_kind):
        raise ApiError(400, "BadRequest", f"the kind in the data ({obj['kind']}) does not "
                                          f"match the expected kind ({want_kind})")
    obj["apiVersion"], obj["kind"] = want_version, want_kind



def admit(call: Call, obj: dict, old: dict | None) -> list[str]:
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
        raise invalid(call, obj, [cause(
            "FieldValueTooLong", "metadata.annotations",
            f"Too long: may not be more than {ANNOTATIONS_MAX_BYTES} bytes")])
    if crd is None:
        return []
    _default(obj, crd.schema)
    causes = _validate(obj, crd.schema, "", old, root=True)
    if causes:
        raise invalid(call, obj, causes)
    return [f'unknown field "{f}"' for f in unknown] if mode == "Warn" else []


def invalid(call: Call, obj: dict, causes: list[dict]) -> ApiError:
    name = (obj.get("metadata") or {}).get("name") or call.name or ""
    listed = [f"{c['field']}: {c['message']}" for c in causes]
    words = listed[0] if len(listed) == 1 else "[" + ", ".join(listed) + "]"
    what = f"{call.info.kind}.{call.key[0]}" if call.key[0] else call.info.kind
    return ApiError(422, "Invalid", f'{what} "{name}" is invalid: {words}',
                    {"name": name, "group": call.key[0], "kind": call.info.kind,
                     "causes": causes})



def check_crd(crd: dict) -> None:
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
                causes.append(cause("FieldValueForbidden", f"{where}.properties[metadata]",
                                     "Forbidden: must not specify anything other than name "
                                     "and generateName, but metadata is implicitly "
                                     "specified"))
        for path, rule in _rules(schema, where):
            if rule.get("rule") not in SUPPORTED_RULES:
                causes.append(cause(
                    "FieldValueInvalid", f"{path}.x-kubernetes-validations",
                    f"Invalid value: {json.dumps(rule.get('rule'))}: the emulator evaluates "
                    f"only the rules {', '.join(SUPPORTED_RULES)}; add the form to "
                    "controller/kube/emulator/admission.py or test against a real cluster"))
    if causes:
        name = (crd.get("metadata") or {}).get("name", "")
        raise ApiError(422, "Invalid", f'CustomResourceDefinition.apiextensions.k8s.io '
                                       f'"{name}" is invalid: '
                                       + ", ".join(f"{c['field']}: {c['message']}"
                                                   for c in causes),
                       {"name": name, "group": "apiextensions.k8s.io",
                        "kind": "CustomResourceDefinition", "causes": causes})


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
        return [cause("FieldValueTypeInvalid", where,
                       f'Invalid value: "null": {where} in body must be of type '
                       f'{schema["type"]}: "null"')]
    kind = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):
        kind = None if isinstance(value, (int, str)) and not isinstance(value, bool) else "string"
    if kind and not _is_type(value, kind):
        return [cause("FieldValueTypeInvalid", where,
                       f'Invalid value: "{_type_name(value)}": {where} in body must be of type '
                       f'{kind}: "{_type_name(value)}"')]
    causes: list[dict] = []
    if "enum" in schema and value not in schema["enum"]:
        causes.append(cause("FieldValueNotSupported", where,
                             f"Unsupported value: {_shown(value)}: supported values: "
                             + ", ".join(_shown(v) for v in schema["enum"])))
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            causes.append(cause("FieldValueTooLong", where,
                                 f"Too long: may not be more than {schema['maxLength']} bytes"))
        if "minLength" in schema and len(value) < schema["minLength"]:
            causes.append(cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should be at "
                                 f"least {schema['minLength']} chars long"))
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            causes.append(cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should match "
                                 f"'{schema['pattern']}'"))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "maximum" in schema and (value > schema["maximum"] or (
                schema.get("exclusiveMaximum") and value == schema["maximum"])):
            causes.append(cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should be less "
                                 f"than {'' if schema.get('exclusiveMaximum') else 'or equal to '}"
                                 f"{schema['maximum']}"))
        if "minimum" in schema and (value < schema["minimum"] or (
                schema.get("exclusiveMinimum") and value == schema["minimum"])):
            causes.append(cause("FieldValueInvalid", where,
                                 f"Invalid value: {_shown(value)}: {where} in body should be "
                                 f"greater than {'' if schema.get('exclusiveMinimum') else 'or '}"
                                 f"{'' if schema.get('exclusiveMinimum') else 'equal to '}"
                                 f"{schema['minimum']}"))
    if isinstance(value, list):
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            causes.append(cause("FieldValueTooMany", where, f"Too many: {len(value)}: must have "
                                                             f"at most {schema['maxItems']} items"))
        if "minItems" in schema and len(value) < schema["minItems"]:
            causes.append(cause("FieldValueInvalid", where,
                                 f"Invalid value: {len(value)}: {where} in body should have at "
                                 f"least {schema['minItems']} items"))
        if isinstance(schema.get("items"), dict):
            for i, v in enumerate(value):
                causes += _validate(v, schema["items"], f"{path}[{i}]", _MISSING)
    if isinstance(value, dict):
        for k in schema.get("required") or []:
            if k not in value:
                causes.append(cause("FieldValueRequired", f"{path}.{k}".lstrip("."),
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
            causes.append(cause("FieldValueInvalid", where,
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


def cause(reason: str, field: str, message: str) -> dict:
    return {"reason": reason, "message": message, "field": field}


def secret_defaults(secret: dict) -> None:
    """A Secret's `stringData` goes into `data` (base64), and its type defaults to Opaque."""
    import base64

    for k, v in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[k] = base64.b64encode(str(v).encode()).decode()
    secret["type"] = secret.get("type") or "Opaque"


def crd_status(crd: dict) -> dict:
    spec = crd.get("spec") or {}
    now = utcnow()
    return {"acceptedNames": spec.get("names") or {},
            "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": now}]}
