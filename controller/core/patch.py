"""JSON merge patches (RFC 7386), as the Kubernetes API applies them to a status."""

from __future__ import annotations

from typing import Any


def merge_patch(old: Any, new: Any) -> Any:
    """The merge patch that turns `old` into `new`.

    A merge patch keeps every key it does not mention, so a key that `new` dropped is sent
    as null (which removes it); nested mappings are diffed the same way; anything else
    (lists included) is replaced whole.
    """
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    out: dict = {}
    for k, v in new.items():
        if k not in old:
            out[k] = v
        elif old[k] != v:
            out[k] = merge_patch(old[k], v) if isinstance(v, dict) and isinstance(old[k], dict) \
                else v
    for k in old:
        if k not in new:
            out[k] = None
    return out
