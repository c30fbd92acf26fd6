"""The words every layer of the emulator shares.

A resource is named by its `Key`, (group, version, plural), as in its URL; an object by its
resource, namespace and name. A request to a resource, its path taken apart, is a `Call`;
a refusal is an `ApiError`, which the HTTP layer answers as the `Status` object a real API
server sends. Nothing here does I/O; every other module of the emulator imports from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kmock._internal import rendering  # the request type kmock records

Key = tuple[str, str, str]                     # (group, version, plural)
ObjKey = tuple[Key, "str | None", str]         # (resource, namespace or None, name)

CRD_KEY: Key = ("apiextensions.k8s.io", "v1", "customresourcedefinitions")
NAMESPACES: Key = ("", "v1", "namespaces")
SECRETS: Key = ("", "v1", "secrets")


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


def api_version(key: Key) -> str:
    return f"{key[0]}/{key[1]}" if key[0] else key[1]


def qualified(key: Key) -> str:
    return f"{key[2]}.{key[0]}" if key[0] else key[2]
