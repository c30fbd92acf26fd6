"""Label and field selectors: which objects a list or a watch is about.

`labelSelector` takes the equality and the set-based forms (`a=b`, `a!=b`, `a in (x,y)`,
`a notin (x)`, `a`, `!a`); `fieldSelector` takes `metadata.name` and `metadata.namespace` on
every kind and the fields a real server allows per kind (`FIELD_LABELS`: `involvedObject.*` on
Events, `spec.nodeName` and `status.phase` on Pods, ...), refusing others as it does. Both turn
into a test of one object, which the store's lists and the watch layer apply.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from controller.kube.emulator.model import ApiError, Call

_LABEL_TERM = re.compile(r"^\s*(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w.-]*)|\s+(in|notin)\s*"
                         r"\(([^)]*)\))?\s*$")


def label_selector(selector: str) -> Callable[[dict], bool]:
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


def field_selector(call: Call) -> Callable[[dict], bool]:
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
