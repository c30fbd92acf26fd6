"""Protobuf: the few request bodies kubectl's typed clients send that way.

`kubectl create namespace|configmap|secret` send protobuf; this reads those three kinds into
the JSON object they hold (a hand-written decoder of the wire format for their few fields), and
refuses any other kind with 415 (`kubectl apply -f` sends JSON). Every answer is JSON.
"""

from __future__ import annotations

from typing import Any

from controller.kube.emulator.model import ApiError

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


def from_protobuf(body: bytes) -> dict:
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
