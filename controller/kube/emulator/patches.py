"""Patches: how a PATCH body changes the stored object.

A JSON merge patch (RFC 7386) works on every kind; the strategic merge patch of the built-in
kinds merges the lists it knows by a key (a Pod's containers by name, ...) rather than replacing
them. JSON patches are applied by `jsonpatch` in the store. Pure functions: the store calls them
inside its write lock.
"""

from __future__ import annotations

import copy
from typing import Any

# Strategic merge patch: lists of the built-in kinds merged by a key rather than replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name",
              "volumes": "name", "env": "name", "imagePullSecrets": "name",
              "ports": "containerPort", "volumeMounts": "mountPath", "ownerReferences": "uid", "conditions": "type"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge, null deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


def strategic_merge(target: Any, patch: Any) -> Any:
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
            out[k] = strategic_merge(out.get(k), v)
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
            out.append(strategic_merge({}, item))
        else:
            out[at] = strategic_merge(out[at], item)
    return out
