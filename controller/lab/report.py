"""The progress report: where the lab stands, in markdown and one chart.

`autolab report` answers the questions a person (or the reporter agent) asks
first: who leads and by how much, how each campaign is going, what ran
recently, what is in flight, and what looks wrong. The anomalies are the ones
that waste GPU time without anyone noticing: runs that have been Running far
longer than the budget allows (stuck), runs that ended without a metric, and
the same refusal again and again (an agent that keeps writing diffs that do
not apply, or keeps proposing a duplicate).

The chart, `research/live/progress.png`, is the autoresearch classic: the
val_bpb of every finished experiment in the order they finished (whole
numbers on the axis: experiment 3, never 2.5), kept (promoted) versus
discarded, the running best (the master's val_bpb as it moved) with each
promotion's name and gain written at its step, and the baseline (the first
master's val_bpb) as a dashed line, so what the lab has won is read off at
a glance. It is drawn with matplotlib's object API on the Agg canvas, so no
display and no global pyplot state are involved.

Everything comes from the ledger, the statuses and master.json; the report
writes `research/live/report.md` and the PNG, and fills in any research
note the controller failed to write (see `controller.lab.memory`). The
recent runs show their MFU and peak GPU memory; a figure that is the
candidate's own word rather than the harness's measurement (the ledger's
`self_reported` column, `controller.core.figures`) is marked as such. The
chart draws val_bpb only, which the harness measures.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from controller.core import figures
from controller.core.spec import LabSpec
from controller.lab import clock, profiles
from controller.lab.files import atomic_write
from controller.lab.ledger import Ledger
from controller.lab.paths import LabPaths
from controller.lab.repo import LabRepo

class LabView(Protocol):
    """What a report reads of a lab (the local front end's `LocalLab` is one)."""

    root: Path
    name: str
    lab: LabSpec
    ledger: Ledger
    repo: LabRepo

    def names(self) -> list[str]: ...

    def read_record(self, name: str) -> dict: ...

STUCK_SLACK_SECONDS = 600.0  # start-up, compilation and evaluation on top of the budget
REFUSALS = ("invalid", "duplicate", "conflict")
RECENT = 10


def _ts(value: str | None) -> _dt.datetime | None:
    if not value:
        return None
    try:
        return clock.parse(value)
    except ValueError:
        return None


def _num(value) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if x == x and abs(x) != float("inf") else None


def _figure(row: dict, key: str) -> str:
    """A ledger figure, followed by figures.MARK where it is the candidate's word."""
    return figures.marked(row.get(key) or "", key in figures.of_row(row))


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s}s" if s < 120 else (f"{s // 60}m" if s < 7200 else f"{s // 3600}h{s % 3600 // 60:02d}m")


def profile_budget(lab: LabView) -> float:
    """The training budget of the lab's profile, from the lab's pinned bench/prepare.py (the
    harness its runs execute); the repository's bench/prepare.py if the lab's cannot say."""
    try:
        return profiles.lab_profile(lab.root, lab.lab.profile, lab.lab.harness).time_budget
    except profiles.ProfileError:
        found = profiles.profiles()
        return found.get(lab.lab.profile, found[profiles.DEFAULT]).time_budget


def default_stuck_after(lab: LabView) -> float:
    budget = lab.lab.budget_seconds or profile_budget(lab)
    return 3 * budget + STUCK_SLACK_SECONDS


# --- the chart -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    index: int
    name: str
    val_bpb: float
    kept: bool


@dataclass(frozen=True)
class Progress:
    points: list[Point]
    best: list[tuple[float, float]]  # (x, running best) steps, starting at the baseline
    baseline: float | None = None  # the first master's val_bpb
    gains: dict[int, float] = field(default_factory=dict)  # point index -> its promotion's gain


def progress(rows: list[dict]) -> Progress:
    """Points (experiments with a val_bpb, in ledger order) and the running best."""
    points: list[Point] = []
    best: list[tuple[float, float]] = []
    gains: dict[int, float] = {}
    baseline: float | None = None
    current: float | None = None
    for row in rows:
        val = _num(row.get("val_bpb"))
        if val is None:
            continue
        if row.get("status") == "baseline":
            if current is None:
                baseline = current = val
                best.append((0.5 + len(points), val))
            continue
        kept = row.get("promoted") == "1"
        points.append(Point(len(points) + 1, row.get("experiment_id", ""), val, kept))
        if kept and (current is None or val < current):
            if current is not None:
                gains[len(points)] = val - current
            current = val
        if current is not None:
            best.append((float(len(points)), current))
    return Progress(points, best, baseline, gains)


def draw_progress(p: Progress, title: str):
    """The progress chart as a matplotlib Figure (on the Agg canvas; nothing is shown)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    gone = [q for q in p.points if not q.kept]
    kept = [q for q in p.points if q.kept]
    ax.scatter([q.index for q in gone], [q.val_bpb for q in gone], s=22, c="#b0b0b0",
               label=f"discarded ({len(gone)})", zorder=2)
    ax.scatter([q.index for q in kept], [q.val_bpb for q in kept], s=46, c="#1f9d55",
               edgecolors="black", linewidths=0.5, label=f"kept ({len(kept)})", zorder=3)
    for q in kept:
        gain = p.gains.get(q.index)
        ax.annotate(q.name + (f" ({gain:+.4f})" if gain is not None else ""),
                    (q.index, q.val_bpb), textcoords="offset points", xytext=(5, -11),
                    fontsize=7, color="#14532d")
    if p.baseline is not None:
        ax.axhline(p.baseline, color="#6b7280", linestyle="--", linewidth=1.1, zorder=0,
                   label=f"baseline, the first master ({p.baseline:.4f})")
    if p.best:
        xs = [x for x, _ in p.best] + [max(len(p.points), 1) + 0.5]
        ys = [y for _, y in p.best] + [p.best[-1][1]]
        ax.step(xs, ys, where="post", color="#1f6feb", linewidth=1.6, label="running best",
                zorder=1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlim(0.5, max(len(p.points), 1) + 0.5)
    ax.set_xlabel("experiment (in the order they finished)")
    ax.set_ylabel("val_bpb (lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if p.points or p.best:
        ax.legend(loc="upper right", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no finished experiment yet", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    return fig


def plot_progress(p: Progress, path: Path, title: str) -> Path:
    fig = draw_progress(p, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    tmp.replace(path)
    return path


# --- the markdown ----------------------------------------------------------------------------

def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return ["(none)"]
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def anomalies(lab: LabView, rows: list[dict], records: dict[str, dict],
              stuck_after: float, now: _dt.datetime) -> list[str]:
    out = []
    for name, r in sorted(records.items()):
        st = r.get("status") or {}
        started = _ts(st.get("startedAt"))
        if st.get("phase") == "Running" and started:
            age = (now - started).total_seconds()
            if age > stuck_after:
                out.append(f"**stuck run**: `{name}` has been Running for {_age(age)} "
                           f"(over {_age(stuck_after)}); `autolab logs {name}` shows whether it "
                           f"still trains, `autolab delete {name}` cancels it")
        created = _ts(st.get("createdAt"))
        if st.get("phase") == "Pending" and created and (now - created).total_seconds() > 600:
            out.append(f"**stuck checks**: `{name}` is still Pending after "
                       f"{_age((now - created).total_seconds())}; is `autolab run` running?")
    no_metric = [r for r in rows if r.get("backend") and r.get("status") != "cancelled"
                 and _num(r.get("val_bpb")) is None]
    for r in no_metric:
        out.append(f"**run without a metric**: `{r.get('experiment_id')}` "
                   f"({r.get('status')}, {r.get('reason') or 'no reason'}): "
                   f"{(r.get('comment') or '').strip()[:160]}")
    refused = [r for r in rows if r.get("status") in REFUSALS]
    by_reason: dict[str, list[str]] = defaultdict(list)
    for r in refused:
        by_reason[r.get("reason") or r.get("status", "")].append(r.get("experiment_id", ""))
    for reason, names in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        if len(names) >= 2:
            shown = ", ".join(f"`{n}`" for n in names[-5:])
            out.append(f"**repeated refusals**: {len(names)} specs refused as {reason} "
                       f"({shown}); check the agents' worktrees and read the messages "
                       "(`autolab describe NAME`)")
    targets = Counter(r.get("duplicate_of") for r in refused if r.get("duplicate_of"))
    for target, n in targets.most_common():
        if n >= 2:
            out.append(f"**repeated duplicate**: {n} specs repeat {target}; the planner and "
                       "reviewer should read research/do-not-repeat.md")
    return out


def build_report(lab: LabView, stuck_after: float | None = None,
                 now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now(_dt.timezone.utc)
    stuck_after = stuck_after if stuck_after is not None else default_stuck_after(lab)
    rows = lab.ledger.rows()
    records = {n: lab.read_record(n) for n in lab.names()}
    m = lab.repo.master_doc()
    out = [f"# Autolab report: lab {lab.name}", "",
           f"_{now.strftime('%Y-%m-%d %H:%M UTC')}; from research/results.tsv, "
           "research/live/master.json and the experiment statuses._", "", "## Leader", ""]
    history = m.get("history", [])
    first = next((h.get("val_bpb") for h in history if h.get("val_bpb") is not None), None)
    val = m.get("val_bpb")
    gain = f"; {val - first:+.6f} since the first measured master" \
        if val is not None and first is not None and len(history) > 1 else ""
    out.append(f"master `{m['hash'][:12]}`: val_bpb "
               f"{'%.6f' % val if val is not None else 'not measured yet'}, set by "
               f"{('`' + m['experiment'] + '`') if m.get('experiment') else 'the seed'}; "
               f"{len(history) - 1} promotion{'s' if len(history) != 2 else ''}{gain}.")
    # campaigns
    stats: dict[str, Counter] = defaultdict(Counter)
    best: dict[str, tuple[float, str]] = {}
    for r in rows:
        if r.get("status") == "baseline":
            continue
        c = r.get("campaign") or "(none)"
        stats[c]["experiments"] += 1
        if r.get("outcome") == "Promoted":
            stats[c]["promoted"] += 1
        elif r.get("outcome") == "Rejected":
            stats[c]["rejected"] += 1
        elif r.get("status") in REFUSALS:
            stats[c]["refused"] += 1
        elif r.get("status") in ("failed", "error"):
            stats[c]["failed"] += 1
        v = _num(r.get("val_bpb"))
        if v is not None and (c not in best or v < best[c][0]):
            best[c] = (v, r.get("experiment_id", ""))
    for n, r in records.items():
        if (r.get("status") or {}).get("phase") in ("Pending", "Queued", "Running"):
            stats[(r.get("spec") or {}).get("campaign") or "(none)"]["in flight"] += 1
    out += ["", "## Campaigns", ""]
    out += _table(["campaign", "finished", "promoted", "rejected", "failed", "refused",
                   "in flight", "best val_bpb"],
                  [[c, str(s["experiments"]), str(s["promoted"]), str(s["rejected"]),
                    str(s["failed"]), str(s["refused"]), str(s["in flight"]),
                    (f"{best[c][0]:.6f} (`{best[c][1]}`)" if c in best else "")]
                   for c, s in sorted(stats.items())])
    # in flight
    out += ["", "## In flight", ""]
    flight = []
    for n, r in sorted(records.items()):
        st = r.get("status") or {}
        if st.get("phase") in ("Pending", "Queued", "Running"):
            since = _ts(st.get("startedAt") or st.get("queuedAt") or st.get("createdAt"))
            flight.append([f"`{n}`", st.get("phase", ""), (st.get("job") or {}).get("slot", "")
                           or "", _age((now - since).total_seconds()) if since else "",
                           (r.get("spec") or {}).get("campaign", "")])
    out += _table(["experiment", "phase", "slot", "for", "campaign"], flight)
    # recent
    out += ["", "## Recent runs", ""]
    out += _table(["finished", "experiment", "campaign", "result", "val_bpb", "delta", "MFU %",
                   "peak VRAM MB"],
                  [[r.get("created_at", ""), f"`{r.get('experiment_id') or r.get('run_id')}`",
                    r.get("campaign", ""),
                    r.get("outcome") or r.get("status", ""),
                    _figure(r, "val_bpb"), r.get("delta", ""), _figure(r, "mfu_percent"),
                    _figure(r, "peak_vram_mb")] for r in rows[-RECENT:][::-1]])
    if any(figures.of_row(r) & {"val_bpb", "mfu_percent", "peak_vram_mb"} for r in rows[-RECENT:]):
        out += ["", f"{figures.MARK}: {figures.EXPLAINED} (its stats.json)."]
    # anomalies
    out += ["", "## Anomalies", ""]
    found = anomalies(lab, rows, records, stuck_after, now)
    out += [f"- {a}" for a in found] or ["None."]
    out += ["", "![progress](progress.png)", ""]
    return "\n".join(out)


def write_report(lab: LabView, stuck_after: float | None = None,
                 png: bool = True) -> tuple[str, Path | None]:
    """Write research/live/report.md (and progress.png); returns the markdown and the PNG."""
    from controller.lab.memory import backfill
    backfill(lab.root, lab.lab.surface, lab.ledger.rows(), lab.read_record)
    md = build_report(lab, stuck_after=stuck_after)
    live = LabPaths.of(lab.root).live
    atomic_write(live / "report.md", md)
    path = None
    if png:
        path = plot_progress(progress(lab.ledger.rows()), live / "progress.png",
                             f"lab {lab.name}: val_bpb of every finished experiment")
    return md, path
