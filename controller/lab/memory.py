"""Research memory: what the controller writes into the lab notebook when an experiment ends.

The ledger is one line per experiment; agents and people also need prose
they can read and grep. When a ledger row is written, the controller writes
`research/experiments/<name>.md` (hypothesis, campaign, parent, the lines the
diff changed, the result, the delta against the master and the outcome) from
the template `research/templates/experiment.md`, and adds the experiments no
one should try again to `research/do-not-repeat.md`, grouped by campaign:
regressions (Rejected with a positive delta beyond the lab's noise) and
duplicates. A change whose difference from the master was inside the noise
(reason WithinNoise) is not a regression: it goes to
`research/no-measurable-effect.md` ("tried, no measurable effect"), which says
nothing about whether it helps, only that one run could not tell. Repeat runs
(confirm, noise) and the first run of a follow-up write no memory: the
experiment's verdict does.

Both are written once per experiment and never rewritten, so people may
annotate them: a note that exists is left alone, and a do-not-repeat entry is
recognised by its name and not added twice. `research/notes.md` and
`research/campaigns/` are the people's (and the memory-keeper's) to write.

Memory is derived from the ledger, so nothing is lost when a write fails:
the hook reports the failure and carries on, and `backfill` (run by
`autolab report`) writes whatever is missing.
"""

from __future__ import annotations

import re
import string
import sys
from pathlib import Path
from typing import Callable

from filelock import FileLock

from controller.core.diffs import DiffRefused, constant_changes, parse_surface_diff
from controller.lab.files import atomic_write
from controller.lab.paths import LabPaths


TEMPLATE = "experiment.md"
NO_CAMPAIGN = "no campaign"
DNR_HEADER = ("# Do not repeat\n\nIdeas that regressed or were duplicates, by campaign. The "
              "controller appends here; people may annotate.\n")


def _repo_templates() -> Path:
    return Path(__file__).resolve().parents[2] / "research" / "templates"


def template_text(lab_root: Path) -> str:
    """The lab's experiment-note template, or the one shipped with autolab."""
    for d in (lab_root / "research" / "templates", _repo_templates()):
        if (d / TEMPLATE).exists():
            return (d / TEMPLATE).read_text(encoding="utf-8")
    raise FileNotFoundError(f"no {TEMPLATE} template in {lab_root / 'research' / 'templates'} "
                            f"or {_repo_templates()}; restore it from the autolab checkout")


def changed_lines(diff: str, surface: str) -> str:
    """The diff's hunks, as the reader wants them: removed and added lines in order."""
    if not diff.strip():
        return "(no diff recorded)"
    try:
        text = parse_surface_diff(diff, surface).text
    except DiffRefused:
        lines = diff.splitlines()
        return "\n".join(lines[:40]) + ("\n… (truncated)" if len(lines) > 40 else "")
    body = [ln for ln in text.splitlines()[2:] if ln.startswith(("@@", "-", "+"))]
    return "\n".join(body)


def _fmt(value: str, digits: int = 6, signed: bool = False) -> str:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return "—"
    return f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}"


def _phase(row: dict) -> str:
    status = row.get("status", "")
    if status == "error":
        return "Failed"
    return status.capitalize() if status else "?"


def experiment_note(row: dict, spec: dict | None, status: dict | None, surface: str,
                    template: str) -> str:
    spec = spec or {}
    status = status or {}
    master = status.get("masterValBpb")
    fields = {
        "name": row.get("experiment_id", ""),
        "campaign": row.get("campaign") or NO_CAMPAIGN,
        "hypothesis": row.get("hypothesis") or spec.get("hypothesis", ""),
        "parent": row.get("parent_hash", "")[:12] or spec.get("parent", ""),
        "rebased_from": (row.get("rebased_from") or "")[:12] or "—",
        "candidate": (row.get("candidate_hash") or "")[:12] or "—",
        "phase": _phase(row),
        "outcome": row.get("outcome") or "—",
        "reason": row.get("reason") or "—",
        "val_bpb": _fmt(row.get("val_bpb", "")),
        "master_val_bpb": _fmt(master) if master is not None else "—",
        "delta": _fmt(row.get("delta", ""), signed=True),
        "training_seconds": _fmt(row.get("training_seconds", ""), 1),
        "backend": row.get("backend") or "—",
        "run_id": row.get("run_id", ""),
        "finished": row.get("created_at", ""),
        "duplicate_of": row.get("duplicate_of") or "—",
        "message": (row.get("comment") or "").strip() or "—",
        "changed_lines": changed_lines(spec.get("diff", ""), surface),
    }
    return string.Template(template).safe_substitute(fields)


NO_EFFECT_HEADER = ("# No measurable effect\n\nChanges whose difference from the master was "
                    "inside the lab's noise, by campaign: not regressions, not wins. A larger "
                    "or combined version may still be worth a run.\n")
# Ledger rows that are not an experiment's verdict: repeat runs, and the first run of a
# follow-up (its experiment runs again on the new master).
NOT_A_VERDICT_STATUSES = ("confirm", "noise", "lost")
NOT_A_VERDICT_REASONS = ("FollowUp",)


# Verdicts whose change a new spec should not simply repeat in the same direction.
SETTLED_REASONS = {"Rejected": "rejected", "WithinNoise": "no measurable effect"}


def change_of(repo, name: str, cache: dict | None = None) -> dict[str, str]:
    """The constants experiment `name` changed, read from its kept branch ({} if gone)."""
    if cache is not None and name in cache:
        return cache[name]
    branch = f"autolab/exp/{name}"
    shown = repo.git("diff", f"{branch}~1", branch, "--", repo.lab.surface, check=False)
    out: dict[str, str] = {}
    if shown.returncode == 0 and shown.stdout.strip():
        try:
            out = constant_changes(parse_surface_diff(shown.stdout, repo.lab.surface))
        except DiffRefused:
            out = {}
    if cache is not None:
        cache[name] = out
    return out


def near_duplicates(repo, rows: list[dict], spec_diff: str, name: str,
                    cache: dict | None = None) -> list[str]:
    """Experiments already judged (rejected, or no measurable effect) that changed one of the
    same constants in the same direction as `spec_diff` does: a near-duplicate, worth a warning
    (it may still be worth running: a different amount, or a different master)."""
    try:
        mine = constant_changes(parse_surface_diff(spec_diff, repo.lab.surface))
    except DiffRefused:
        return []
    if not mine:
        return []
    out = []
    seen: set[str] = set()
    for row in rows:
        other = row.get("experiment_id", "")
        verdict = SETTLED_REASONS.get(row.get("reason", ""))
        if not other or other == name or other in seen or row.get("outcome") != "Rejected" \
                or verdict is None:
            continue
        seen.add(other)
        same = sorted(c for c, d in change_of(repo, other, cache).items()
                      if mine.get(c) == d)
        if same:
            what = ", ".join(f"{c} {mine[c]}" for c in same)
            out.append(f"{other} ({verdict}, val_bpb {_fmt(row.get('val_bpb'))}) also moved "
                       f"{what}")
    return out


def no_effect_reason(row: dict) -> str | None:
    """Why an experiment belongs in no-measurable-effect.md, or None."""
    if row.get("reason") != "WithinNoise":
        return None
    return (f"no measurable effect: val_bpb {_fmt(row.get('val_bpb'))}, "
            f"{_fmt(row.get('delta'), signed=True)} against the master, inside the lab's noise")


def do_not_repeat_reason(row: dict) -> str | None:
    """Why an experiment belongs in do-not-repeat.md, or None."""
    if row.get("reason") == "WithinNoise":
        return None  # inside the noise: its own list (no_effect_reason)
    if row.get("status") == "duplicate":
        return f"duplicate of {row.get('duplicate_of') or 'an earlier candidate'}"
    try:
        delta = float(row.get("delta", ""))
    except ValueError:
        return None
    if row.get("outcome") == "Rejected" and delta > 0:
        return (f"regressed: val_bpb {_fmt(row.get('val_bpb'))}, "
                f"{_fmt(row.get('delta'), signed=True)} against the master")
    return None


def _entry(row: dict, spec: dict | None, surface: str, why: str) -> str:
    added = []
    try:
        added = list(parse_surface_diff((spec or {}).get("diff", ""), surface).added)
    except DiffRefused:
        pass
    change = ""
    if added:
        shown = "; ".join(f"`{a.strip()}`" for a in added[:2] if a.strip())
        change = f" Change: {shown}{' …' if len(added) > 2 else ''}." if shown else ""
    name = row["experiment_id"]
    # One list item, one line: a hypothesis may hold line breaks (its own or U+2028), which
    # would forge entries or headings (and an entry of another name makes its real one "present").
    hypothesis = " ".join(str(row.get("hypothesis", "")).split())
    return (f"- `{name}` ({row.get('created_at', '')[:10]}): {hypothesis} "
            f"— {why}.{change} [note](experiments/{name}.md)\n")


def add_do_not_repeat(path: Path, campaign: str, name: str, entry: str,
                      header: str = DNR_HEADER) -> bool:
    """Insert `entry` at the end of the campaign's section (made if missing). False: present."""
    text = path.read_text(encoding="utf-8") if path.exists() else header
    if re.search(rf"^- `{re.escape(name)}`", text, re.M):
        return False
    heading = f"## {campaign}"
    lines = text.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    start = next((i for i, ln in enumerate(lines) if ln.rstrip("\n") == heading), None)
    if start is None:
        if lines and lines[-1].strip():
            lines.append("\n")
        lines += [heading + "\n", "\n", entry]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        while end > start + 1 and not lines[end - 1].strip():
            end -= 1  # before the blank lines that end the section
        lines.insert(end, entry)
    atomic_write(path, "".join(lines))
    return True


def remember(lab_root: Path, surface: str, row: dict, spec: dict | None,
             status: dict | None) -> list[Path]:
    """Write the note (if missing) and the do-not-repeat entry (if due) of one ledger row."""
    name = row.get("experiment_id", "")
    if not name or name in ("baseline", "noise") or row.get("status") in NOT_A_VERDICT_STATUSES \
            or row.get("reason") in NOT_A_VERDICT_REASONS:
        return []
    research = LabPaths.of(lab_root).research
    written = []
    lock = FileLock(str(LabPaths.of(lab_root).lock("research")))
    with lock:
        note = research / "experiments" / f"{name}.md"
        if not note.exists():
            atomic_write(note, experiment_note(row, spec, status, surface,
                                               template_text(lab_root)))
            written.append(note)
        why = do_not_repeat_reason(row)
        if why:
            dnr = research / "do-not-repeat.md"
            if add_do_not_repeat(dnr, row.get("campaign") or NO_CAMPAIGN, name,
                                 _entry(row, spec, surface, why)):
                written.append(dnr)
        why = no_effect_reason(row)
        if why:
            nme = research / "no-measurable-effect.md"
            if add_do_not_repeat(nme, row.get("campaign") or NO_CAMPAIGN, name,
                                 _entry(row, spec, surface, why), NO_EFFECT_HEADER):
                written.append(nme)
    return written


def remember_quietly(paths, lab_name: str, surface: str, row: dict, spec: dict | None,
                     status: dict | None) -> None:
    """After-record hook: the research notes of the experiment whose ledger row was written."""
    try:
        remember(paths.root, surface, row, spec, status)
    except Exception as e:  # memory must never stop the controller; backfill repairs it
        print(f"warning: could not write the research notes of {row.get('experiment_id')}: {e}; "
              "`autolab report` writes missing notes", file=sys.stderr)


def backfill(lab_root: Path, surface: str, rows: list[dict],
             record: Callable[[str], dict]) -> list[Path]:
    """Notes and do-not-repeat entries for every ledger row that lacks them.

    `record(name)` gives what the controller kept of an experiment ({"spec", "status"}).
    """
    written: list[Path] = []
    for row in rows:
        name = row.get("experiment_id", "")
        if not name or name == "baseline":
            continue
        r = record(name)
        written += remember(lab_root, surface, row, r.get("spec"), r.get("status"))
    return written
