"""What `autolab get` lists and in which order: kubectl's label selectors and `--sort-by`.

A selector is kubectl's equality form, comma-separated and all required:
`campaign=schedule`, `owner!=bob`, `tuned` (the label is set), `!tuned` (it is not).
Labels are the spec file's `metadata.labels`. `--sort-by` takes a field path of the
Experiment as `-o json` prints it (`.status.metrics.val_bpb`, `{.status.delta}`;
camelCase shorthands such as `.status.valBpb` name the metric of the same name) or a
column of the table (`VAL_BPB`, `delta`, `age`, `queue`). Experiments that lack the field go
last, as kubectl puts them. QUEUE is a waiting experiment's place in the lab's queue (1: the
next free slot is its), by the slot book's rule (`controller.core.slots.queue_order`); `-o
json` carries it as `status.queuePosition`.
"""

from __future__ import annotations

import re

from controller.cli.output import CliError, item

_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?$")

# The columns of `autolab get` and the field each shows.
COLUMNS = {
    "NAME": ".metadata.name", "PHASE": ".status.phase", "OUTCOME": ".status.outcome",
    "VAL_BPB": ".status.metrics.val_bpb", "DELTA": ".status.delta", "SLOT": ".status.job.slot",
    "QUEUE": ".status.queuePosition",
    "CAMPAIGN": ".spec.campaign", "AGE": ".status.createdAt", "MFU": ".status.metrics.mfu_percent",
    "VRAM_MB": ".status.metrics.peak_vram_mb", "CANDIDATE": ".status.candidateHash",
    "PARENT": ".status.parentHash", "MESSAGE": ".status.message",
}


def parse_selector(text: str) -> list[tuple[str, str, str | None]]:
    """`a=b,c!=d,e,!f` -> [(key, op, value)], op one of = != exists absent."""
    out: list[tuple[str, str, str | None]] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([^=!\s]+)\s*(==|=|!=)\s*(\S*)", part)
        if m:
            key, op, value = m.group(1), "!=" if m.group(2) == "!=" else "=", m.group(3)
        elif part.startswith("!") and _LABEL.match(part[1:]):
            key, op, value = part[1:], "absent", None
        elif _LABEL.match(part):
            key, op, value = part, "exists", None
        else:
            raise CliError(f"-l {text}: cannot read {part!r}; write key=value, key!=value, key "
                           "or !key, joined by commas")
        if not _LABEL.match(key):
            raise CliError(f"-l {text}: {key!r} is not a label key")
        out.append((key, op, value))
    return out


def matches(labels: dict, selector: list[tuple[str, str, str | None]]) -> bool:
    for key, op, value in selector:
        have = labels.get(key)
        if op == "=" and have != value:
            return False
        if op == "!=" and have == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "absent" and key in labels:
            return False
    return True


def labels_of(record: dict) -> dict:
    labels = (record.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {}


def select(records: dict[str, dict], selector: str | None) -> dict[str, dict]:
    if not selector:
        return records
    sel = parse_selector(selector)
    return {n: r for n, r in records.items() if matches(labels_of(r), sel)}


_MISSING = object()


def _walk(doc, keys: list[str]):
    for k in keys:
        if isinstance(doc, dict) and k in doc:
            doc = doc[k]
        elif isinstance(doc, list) and k.isdigit() and int(k) < len(doc):
            doc = doc[int(k)]
        else:
            return _MISSING
    return doc


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def field_path(spec: str) -> tuple[list[str], bool]:
    """The keys a `--sort-by` names, and whether it sorts newest first (AGE)."""
    text = spec.strip()
    column = COLUMNS.get(text.upper().replace("-", "_"))
    if column is not None:
        return column.lstrip(".").split("."), text.upper() == "AGE"
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    if not text.startswith(".") or len(text) < 2:
        raise CliError(f"--sort-by {spec}: expected a field such as .status.metrics.val_bpb or "
                       f"a column ({', '.join(COLUMNS)})")
    return [k for k in re.split(r"\.|\[|\]", text[1:]) if k], False


def sort_records(records: dict[str, dict], spec: str | None) -> dict[str, dict]:
    if not spec:
        return records
    keys, newest_first = field_path(spec)
    docs = {n: item(n, r) for n, r in records.items()}

    def value(doc):
        v = _walk(doc, keys)
        if v is _MISSING and len(keys) >= 2 and keys[0] == "status":  # .status.valBpb
            v = _walk(doc, ["status", "metrics", _snake(keys[-1])])
        return v

    values = {n: value(d) for n, d in docs.items()}
    if records and all(v is _MISSING for v in values.values()):
        raise CliError(f"--sort-by {spec}: no experiment has that field; try "
                       ".status.metrics.val_bpb, .status.delta or a column "
                       f"({', '.join(COLUMNS)})")

    def key(n: str):
        v = values[n]
        if v is _MISSING or v is None:
            return (2, 0, "", n)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return (0, float(v), "", n)
        return (1, 0, str(v), n)

    order = sorted(records, key=key)
    if newest_first:  # AGE ascending: the youngest first, as the column reads
        present = [n for n in order if key(n)[0] < 2]
        order = present[::-1] + [n for n in order if key(n)[0] == 2]
    return {n: records[n] for n in order}
