"""Tables: what `kubectl get` shows (the rows of a `meta.k8s.io/v1` Table).

A client that asks for `as=Table;v=v1;g=meta.k8s.io` gets rows instead of objects: a CRD's
`additionalPrinterColumns` (their simple JSONPaths evaluated here; kubectl shows the priority>0
ones only with `-o wide`), and for the built-in kinds the columns a real cluster shows (Pods:
READY, STATUS, RESTARTS; Jobs: STATUS, COMPLETIONS; Events: LAST SEEN, TYPE, REASON, OBJECT,
MESSAGE; ...), with ages printed as kubectl prints them. Pure functions; the HTTP and watch
layers call them.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from typing import Any

from controller.kube.emulator.model import Call


def as_table(call: Call, items: list[dict], revision: int, list_meta: dict | None = None,
             headers: bool = True) -> dict:
    """`items` as the rows of a Table; `revision` is the store's, for a Table of no list."""
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
            "metadata": list_meta or {"resourceVersion": str(revision)},
            "columnDefinitions": columns if headers else [], "rows": rows}


def wants_table(accept: str) -> bool:
    for media in accept.split(","):
        params = dict(p.strip().partition("=")[::2] for p in media.split(";")[1:])
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io":
            return True
    return False



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
