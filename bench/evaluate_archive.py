"""1. The archive, before torch sees it.

`torch.export.load` would unpickle, `exec` and `eval` parts of a model.pt2, so the zip is read
once into memory and every member is checked against the layout `prepare.export_model` writes
(see evaluate.py's docstring for the layout and what is refused). Torch then loads a NEW archive
rebuilt from exactly the checked bytes (`rebuild_archive`), so no zip-parser disagreement can
slip a member past the checks.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from pathlib import Path
from typing import Any

from evaluate_common import (ALLOWED_HIGHER_ORDER_OPS, ATEN_TARGET, COUNTER_MEMBERS, DENIED_ATEN_OPS, Failure,
                             FIXED_MEMBERS, MAX_ARCHIVE_BYTES, MAX_ARCHIVE_MEMBERS, MAX_JSON_BYTES, NO_EXPORT,
                             PAYLOADS, PLAIN_ARGUMENTS, PROGRAM_JSON, refuse, SAMPLE_INPUTS, STATE_NAME)


def read_archive(path: Path) -> dict[str, bytes]:
    """The members of the zip at `path`, by their name under its single root folder."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_ARCHIVE_BYTES:
                raise refuse(f"{path} is {size:,} bytes, over the limit of {MAX_ARCHIVE_BYTES:,}")
            data = f.read(MAX_ARCHIVE_BYTES + 1)
    except FileNotFoundError:
        raise Failure("candidate", f"no exported model at {path}", NO_EXPORT) from None
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
        if len(infos) > MAX_ARCHIVE_MEMBERS:
            raise refuse(f"{path} has {len(infos):,} members, over the limit of {MAX_ARCHIVE_MEMBERS:,}")
        members: dict[str, bytes] = {}
        roots, total = set(), 0
        for info in infos:
            parts = _member_parts(info)
            total += info.file_size
            if total > MAX_ARCHIVE_BYTES:
                raise refuse(f"the members of {path} add up to over {MAX_ARCHIVE_BYTES:,} bytes")
            roots.add(parts[0])
            rel = "/".join(parts[1:])
            if rel in members:
                raise refuse(f"member {info.filename!r} appears twice")
            members[rel] = zf.read(info)  # checks the CRC and that the local header names the same file
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as e:
        raise refuse(f"{path} is not a readable zip archive: {e}") from e
    if len(roots) != 1:
        raise refuse(f"the members of {path} must share one root folder, not {sorted(roots)[:5]}")
    return members


def _member_parts(info: zipfile.ZipInfo) -> list[str]:
    name = info.filename
    parts = name.split("/")
    if (not name or name.startswith("/") or "\\" in name or "\x00" in name or re.match(r"[A-Za-z]:", name)
            or len(parts) < 2 or any(p in ("", ".", "..") for p in parts)):
        raise refuse(f"member {name!r} has an unsafe or unexpected path (absolute, '..', a folder entry)")
    if info.flag_bits & 0x1:
        raise refuse(f"member {name!r} is encrypted")
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise refuse(f"member {name!r} is compressed; torch.export.save stores members uncompressed")
    return parts


def check_archive(members: dict[str, bytes]) -> dict[str, bytes]:
    """Refuse what is not the layout export_model writes; returns the members torch may load."""
    for rel in members:
        if not _expected_member(rel):
            raise refuse(f"unexpected member {rel!r} (export_model writes only a graph, raw weights and "
                         "raw constants; pickles, custom objects, compiled code and extra files are refused)")
    for rel, allowed in FIXED_MEMBERS.items():
        if members.get(rel, b"").strip() not in allowed:
            raise refuse(f"member {rel!r} must hold one of {sorted(allowed)}")
    for rel in COUNTER_MEMBERS & members.keys():
        if not re.fullmatch(rb"\d{1,64}\n?", members[rel]):
            raise refuse(f"member {rel!r} must hold a number")
    if members.get(SAMPLE_INPUTS):
        raise refuse(f"{SAMPLE_INPUTS} holds {len(members[SAMPLE_INPUTS]):,} bytes of pickled sample inputs, "
                     "which torch.export.load would unpickle; prepare.export_model saves none")
    clean = {rel: members[rel] for rel in FIXED_MEMBERS}
    clean[SAMPLE_INPUTS] = b""
    for folder, (config_name, pattern) in PAYLOADS.items():
        config = _check_payload_config(members, config_name, pattern)
        for rel in members:
            if rel.startswith(folder) and rel != config_name and rel[len(folder):] not in config:
                raise refuse(f"member {rel!r} is not named by {config_name}")
        clean[config_name] = members[config_name]
        clean.update({folder + name: members[folder + name] for name in config})
    if PROGRAM_JSON not in members:
        raise refuse(f"the archive has no {PROGRAM_JSON}")
    clean[PROGRAM_JSON] = check_program_json(members[PROGRAM_JSON])
    return clean


def _expected_member(rel: str) -> bool:
    if rel in FIXED_MEMBERS or rel in COUNTER_MEMBERS or rel in (PROGRAM_JSON, SAMPLE_INPUTS):
        return True
    return any(rel == config or (rel.startswith(folder) and pattern.fullmatch(rel[len(folder):]))
               for folder, (config, pattern) in PAYLOADS.items())


def _check_payload_config(members: dict[str, bytes], config_name: str, pattern: re.Pattern) -> set[str]:
    """The raw tensor members a weights/constants config names; refuses pickles and odd entries."""
    doc = _json_member(members, config_name)
    entries = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(entries, dict):
        raise refuse(f"{config_name} has no 'config' object")
    names = set()
    for fqn, entry in entries.items():
        if not STATE_NAME.fullmatch(fqn):
            raise refuse(f"{config_name} names a tensor {fqn!r}; names are dotted identifiers")
        if not isinstance(entry, dict) or entry.get("use_pickle") is not False:
            raise refuse(f"{fqn!r} in {config_name} is stored as a pickle (use_pickle); only raw tensor "
                         "bytes are accepted (a tensor subclass, a torchbind or an opaque object?)")
        path_name = entry.get("path_name")
        if not isinstance(path_name, str) or not pattern.fullmatch(path_name):
            raise refuse(f"{fqn!r} in {config_name} points at {path_name!r}, not a raw tensor member")
        if not isinstance(entry.get("tensor_meta"), dict):
            raise refuse(f"{fqn!r} in {config_name} has no tensor_meta")
        if config_name.rsplit("/", 1)[0] + "/" + path_name not in members:
            raise refuse(f"{fqn!r} in {config_name} points at {path_name!r}, which the archive lacks")
        names.add(path_name)
    return names


def _json_member(members: dict[str, bytes], rel: str) -> Any:
    raw = members.get(rel)
    if raw is None:
        raise refuse(f"the archive has no {rel}")
    if len(raw) > MAX_JSON_BYTES:
        raise refuse(f"{rel} is {len(raw):,} bytes, over the limit of {MAX_JSON_BYTES:,}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise refuse(f"{rel} is not JSON: {e}") from e


def check_program_json(raw: bytes) -> bytes:
    """Refuse a graph that loading would turn into code; return it without node metadata."""
    doc = _json_member({PROGRAM_JSON: raw}, PROGRAM_JSON)
    if not isinstance(doc, dict) or not isinstance(doc.get("graph_module"), dict):
        raise refuse(f"{PROGRAM_JSON} is not a serialized ExportedProgram")
    if doc.get("guards_code"):
        raise refuse("the program carries guards_code (Python source that ExportedProgram.module() executes)")
    if doc.get("range_constraints"):
        raise refuse("the program has symbolic shapes (range_constraints); export_model exports one fixed shape")
    graph = doc["graph_module"].get("graph")
    if not isinstance(graph, dict):
        raise refuse(f"{PROGRAM_JSON} has no graph")
    for key in ("sym_int_values", "sym_bool_values", "sym_float_values", "custom_obj_values"):
        if graph.get(key):
            raise refuse(f"the graph has {key} (symbolic values or custom objects)")
    _check_signature_json(doc["graph_module"].get("signature"))
    try:
        _walk_program_json(doc)
    except RecursionError:
        raise refuse(f"{PROGRAM_JSON} is nested too deeply") from None
    return json.dumps(doc).encode()


def _check_signature_json(signature: Any) -> None:
    if not isinstance(signature, dict):
        raise refuse("the program has no signature")
    state_keys = {"parameter": "parameter_name", "buffer": "buffer_name", "tensor_constant": "tensor_constant_name"}
    inputs = signature.get("input_specs") or []
    for spec in inputs:
        kind = next(iter(spec), None) if isinstance(spec, dict) and len(spec) == 1 else None
        if kind not in (*state_keys, "user_input"):
            raise refuse(f"the program takes an input of kind {kind!r}; only the token ids, parameters, "
                         "buffers and tensor constants are accepted")
        name = spec[kind].get(state_keys[kind]) if kind in state_keys else None
        if kind in state_keys and not (isinstance(name, str) and STATE_NAME.fullmatch(name)):
            raise refuse(f"the program names a {kind} {name!r}; names are dotted identifiers")
    outputs = signature.get("output_specs") or []
    if [next(iter(o), None) for o in outputs if isinstance(o, dict)] != ["user_output"]:
        raise refuse("the program must have exactly one output, the logits, and no mutations "
                     f"(its outputs are {[next(iter(o), None) for o in outputs if isinstance(o, dict)]})")


def _walk_program_json(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _walk_program_json(item)
        return
    if not isinstance(node, dict):
        return
    for key in node:
        if key.startswith("as_") and key not in PLAIN_ARGUMENTS:
            raise refuse(f"the graph has an argument of kind {key!r} (symbolic values, custom objects and "
                         "operators as values are not accepted)")
    if "as_graph" in node and not re.fullmatch(r"submod_\d{1,6}", str((node["as_graph"] or {}).get("name"))):
        raise refuse("a region of the graph has an unexpected name; the autocast/grad-mode regions are submod_<n>")
    if "target" in node and "inputs" in node:
        _check_target_json(node["target"])
        node["metadata"] = {}  # stack traces and module paths: text the loader parses, unneeded here
    for value in node.values():
        _walk_program_json(value)


def _check_target_json(target: Any) -> None:
    if not isinstance(target, str):
        raise refuse(f"a graph node has the target {target!r}")
    if m := ATEN_TARGET.fullmatch(target):
        if m.group(1) in DENIED_ATEN_OPS:
            raise refuse(f"the graph calls {target}, which reads or writes files or process-wide state, or hands "
                         "out uninitialised memory")
        return
    if target.removeprefix("torch.ops.higher_order.") in ALLOWED_HIGHER_ORDER_OPS:
        return
    raise refuse(f"the graph calls {target!r}; only aten operators and the autocast/grad-mode regions "
                 "are accepted (no Python functions, custom or extension operators)")


def rebuild_archive(members: dict[str, bytes]) -> io.BytesIO:
    """A fresh zip, written by torch's own writer, holding exactly the checked members."""
    from torch.export.pt2_archive import PT2ArchiveWriter

    buffer = io.BytesIO()
    with PT2ArchiveWriter(buffer) as writer:
        for rel, data in members.items():
            if not writer.has_record(rel):  # the writer adds its own byteorder in some versions
                writer.write_bytes(rel, data)
    buffer.seek(0)
    return buffer
