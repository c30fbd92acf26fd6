"""Output helpers and the errors every `autolab` command shares."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from controller.core import figures
from controller.core.errors import InputError
from controller.core.spec import API_VERSION

REPO_ROOT = Path(__file__).resolve().parents[2]


def autolab_command() -> str:
    """How the person who started this process runs `autolab`: through `./dev` (which puts
    the clone's venv on PATH for its own child only) the dev script's full path, else `autolab`."""
    import os
    dev = os.environ.get("AUTOLAB_DEV")
    return f"{dev} autolab" if dev else "autolab"


def activate_hint() -> str:
    """A note on putting `autolab` on PATH, for someone who came through `./dev`; else ''."""
    import os
    dev = os.environ.get("AUTOLAB_DEV")
    if not dev:
        return ""
    return f" (or `source {Path(dev).parent / '.venv' / 'bin' / 'activate'}` once, then `autolab ...`)"


class CliError(InputError):
    """A known failure of a command: `autolab` prints it on one line and exits 1."""


_LINE_BREAKS = re.compile(r"\s*[\r\n]+\s*")


def one_line(text: object) -> str:
    """A message on one line: every line break (and the blanks around it) becomes one space."""
    return _LINE_BREAKS.sub(" ", str(text)).strip()


def _age(ts: str | None) -> str:
    if not ts:
        return ""
    import datetime as dt
    t = dt.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    s = int((dt.datetime.now(dt.timezone.utc) - t).total_seconds())
    return f"{s}s" if s < 120 else (f"{s // 60}m" if s < 7200 else f"{s // 3600}h")


def _fmt(v, nd=6) -> str:
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def number(text: object, nd: int = 6, signed: bool = False) -> str:
    """A metric as people read it: `0.963412`, a delta `-0.012300`; text that is not a number
    (an empty cell) as it is."""
    try:
        v = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "" if text is None else str(text)
    if v != v:
        return "nan"
    return f"{v:+.{nd}f}" if signed else f"{v:.{nd}f}"


def gain_interval(step: dict | None) -> str:
    """A decision's gain over the master with its 95 % interval: `+0.006800 [+0.0051, +0.0085]`
    (positive: better than the master)."""
    if not isinstance(step, dict) or step.get("gain") is None:
        return ""
    low, high = (step.get("interval") or [None, None])[:2]
    if low is None or high is None:
        return f"{step['gain']:+.6f}"
    return f"{step['gain']:+.6f} [{low:+.4f}, {high:+.4f}]"


def figure(st: dict, key: str, nd: int = 1) -> str:
    """A run's figure for a table, followed by figures.MARK where it is the candidate's word."""
    v = (st.get("metrics") or {}).get(key)
    text = "" if v is None else (f"{v:.{nd}f}" if isinstance(v, (int, float)) else str(v))
    return figures.marked(text, key in figures.of_status(st))


def table_rows(rows, wide: bool = False) -> tuple[list[str], list[list[str]]]:
    head = ["NAME", "PHASE", "OUTCOME", "VAL_BPB", "DELTA", "SLOT", "QUEUE", "CAMPAIGN", "AGE"]
    if wide:
        head += ["MFU", "VRAM_MB", "CANDIDATE", "PARENT", "PAIRS", "GAIN", "MESSAGE"]
    out = []
    for name, st, spec in rows:
        job = st.get("job") or {}
        slot = job.get("slot", "") if st.get("phase") in ("Queued", "Running") else ""
        line = [name, st.get("phase", "Pending"), st.get("outcome", ""),
                _fmt((st.get("metrics") or {}).get("val_bpb")),
                ("" if st.get("delta") is None else f"{st['delta']:+.6f}"), str(slot or ""),
                str(st.get("queuePosition") or ""),  # its place in the queue, where it waits
                spec.get("campaign", ""), _age(st.get("createdAt"))]
        if wide:
            pairs = st.get("pairs") if isinstance(st.get("pairs"), dict) else {}
            line += [figure(st, "mfu_percent", 2), figure(st, "peak_vram_mb"),
                     (st.get("candidateHash") or "")[:12], (st.get("parentHash") or "")[:12],
                     str(len(pairs.get("master") or [])) if pairs else "",
                     gain_interval(pairs.get("verdict") or pairs.get("estimate")),
                     (st.get("message") or "").split("\n")[0]]  # whole: wide is for reading
        out.append(line)
    return head, out


def print_table(head: list[str], rows: list[list[str]], out=None,
                widths: list[int] | None = None, header: bool = True) -> list[int]:
    """Columns padded to their widest cell (or to `widths`); returns the widths used."""
    out = out or sys.stdout
    widths = widths or [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
                        for i, h in enumerate(head)]
    for r in ([head] if header else []) + rows:
        out.write("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
    return widths


def item(name: str, record: dict) -> dict:
    meta: dict = {"name": name, "generation": record.get("generation", 1)}
    labels = (record.get("metadata") or {}).get("labels")
    if labels:
        meta["labels"] = labels
    created = (record.get("metadata") or {}).get("creationTimestamp")
    if created:
        meta["creationTimestamp"] = created
    return {"apiVersion": API_VERSION, "kind": "Experiment", "metadata": meta,
            "spec": record.get("spec") or {}, "status": record.get("status") or {}}


_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text a spec carried, safe for a terminal: control characters and lone surrogates escaped."""
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)
