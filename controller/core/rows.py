"""The ledger rows the lifecycle writes: one per run, in the seed ledger's columns.

`ledger_row` is a terminal experiment's verdict row, `pair_row` a pair run's after the first
(or a run lost for a reason outside the candidate), `master_run_row` a run of the master
itself (a baseline, a noise run). `carried_values` reads rows back: what unfinished decisions
of a candidate measured on a master, which a new decision of it may carry on from. The rows
keep `research/results.tsv`'s columns in order; new columns go at the end.
"""

from __future__ import annotations

from controller.core import figures
from controller.core.spec import ExperimentSpec
from controller.core.status import FAILED, NOT_MEASURED, PROMOTED, UNDECIDED
from controller.core.world import Master, RunObservation, finite, run_name


def ledger_row(name: str, spec: ExperimentSpec | None, st: dict) -> dict:
    """The ledger row of a terminal experiment (created_at and worker_id come from the shell)."""
    metrics = st.get("metrics") or {}
    job = st.get("job") or {}
    phase = st.get("phase", "")
    status = phase.lower()
    if phase == FAILED and st.get("reason") in NOT_MEASURED:
        status = "error"  # not a measurement of the candidate: it may run again
    if st.get("outcome") == UNDECIDED:
        status = "undecided"  # not a measured rejection either: applied again, it continues

    def num(key: str) -> str:
        v = metrics.get(key)
        return "" if v is None else str(v)

    row = {
        "run_id": st.get("run") or job.get("name") or run_name(name),
        "status": status,
        "job_id": job.get("id", ""),
        "campaign": spec.campaign if spec else "",
        "experiment_id": name,
        "worker_id": job.get("worker", ""),
        "hypothesis": spec.hypothesis if spec else "",
        "parent_hash": st.get("parentHash") or (spec.parent if spec else ""),
        "candidate_hash": st.get("candidateHash", ""),
        "val_bpb": num("val_bpb"),
        "training_seconds": num("training_seconds"),
        "total_seconds": num("total_seconds"),
        "peak_vram_mb": num("peak_vram_mb"),
        "mfu_percent": num("mfu_percent"),
        "promoted": "1" if st.get("outcome") == PROMOTED else "0",
        "comment": st.get("message", ""),
        "semantic_hash": st.get("semanticHash", ""),
        "outcome": st.get("outcome", ""),
        "delta": "" if st.get("delta") is None else str(st["delta"]),
        "rebased_from": st.get("rebasedFrom", ""),
        "duplicate_of": st.get("duplicateOf", ""),
        "backend": job.get("backend", ""),
        "reason": st.get("verdict") or st.get("reason", ""),
    }
    row[figures.COLUMN] = _own_columns(figures.of_status(st), row)
    return row


def pair_row(name: str, spec: ExperimentSpec | None, st: dict, job: dict,
             run: RunObservation, val: float | None, status: str | None = None) -> dict:
    """The ledger row of one pair run after the first (status `confirm`; `failed` if the
    candidate failed it), or of any run lost for a reason outside the candidate (`lost`: not
    a measurement; its place is run again). A master's run carries the master's hash: it
    measures that program.
    """
    program = job.get("program", "candidate")
    metrics = (run.result or {}).get("metrics") or {}
    status = status or ("confirm" if val is not None else "failed")
    row = {"run_id": job["name"], "status": status, "job_id": run.job_id or job.get("id", ""),
           "campaign": spec.campaign if spec else "", "experiment_id": name,
           "worker_id": run.worker or job.get("worker", ""),
           "hypothesis": (f"Lost run of {name}: the {program} at place {job.get('place')}."
                          if status == "lost" else
                          f"Pair run of {name}: the {program} at place {job.get('place')}."),
           "parent_hash": st.get("parentHash", ""),
           "candidate_hash": st.get("candidateHash", "") if program == "candidate"
           else st.get("parentHash", ""),
           "semantic_hash": st.get("semanticHash", "") if program == "candidate" else "",
           "val_bpb": "" if val is None else str(val), "promoted": "0",
           "comment": "" if val is not None else ((run.result or {}).get("reason")
                                                   or run.message),
           "outcome": "", "backend": job.get("backend", ""),
           "reason": "" if val is not None else ((run.result or {}).get("reason_code") or ""),
           "rebased_from": "", "duplicate_of": "", "delta": ""}
    for k in FIGURE_COLUMNS[1:]:  # after val_bpb, set above
        row[k] = "" if metrics.get(k) is None else str(metrics[k])
    row[figures.COLUMN] = _own_columns(set(figures.of_result(run.result, metrics)), row)
    return row


FIGURE_COLUMNS = figures.LEDGER_FIGURES


def _own_columns(own: set[str], row: dict) -> str:
    """The ledger's self_reported cell: the row's filled figure columns that are the candidate's."""
    return figures.column(k for k in FIGURE_COLUMNS if k in own and row.get(k, "") != "")


def carried_values(rows: list[dict], candidate_hash: str, parent_hash: str,
                   name: str) -> tuple[tuple[str, ...], dict] | None:
    """What unfinished decisions of this candidate on this master measured (`World.carried`).

    From the ledger `rows`: experiments other than `name` whose verdict row says `undecided` or
    `error` (no verdict: runs lost, the machine) for `candidate_hash`, and their runs of that
    program on `parent_hash` with a value, by place: `exp-<e>-<attempt>` is place 1,
    `exp-<e>-<attempt>-p<i>` place i (a `-t<k>` retry is the same place). None: nothing.
    """
    if not candidate_hash or not parent_hash:
        return None
    unfinished = []
    for r in rows:
        e = r.get("experiment_id") or ""
        if r.get("candidate_hash") == candidate_hash and e != name and e not in unfinished \
                and r.get("status") in ("undecided", "error") \
                and r.get("run_id", "").startswith(f"exp-{e}-"):
            unfinished.append(e)
    values: dict[int, float] = {}
    for r in rows:
        e = r.get("experiment_id") or ""
        if e not in unfinished or r.get("candidate_hash") != candidate_hash \
                or r.get("parent_hash") != parent_hash:
            continue
        rest = (r.get("run_id") or "")[len(f"exp-{e}-"):].split("-")
        if rest and rest[-1][:1] == "t" and rest[-1][1:].isdigit():
            rest = rest[:-1]
        if not rest or not rest[0].isdigit() or len(rest) > 2 \
                or (len(rest) == 2 and not (rest[1][:1] == "p" and rest[1][1:].isdigit())):
            continue
        place = int(rest[1][1:]) if len(rest) == 2 else 1
        try:
            val = float(r.get("val_bpb") or "")
        except ValueError:
            continue
        if finite(val):
            values.setdefault(place, val)
    return (tuple(unfinished), values) if values else None


def master_run_row(master: Master, run: RunObservation) -> tuple[dict, float | None]:
    """The ledger row of a finished run of the master itself (a baseline, a noise run) and
    its val_bpb (None: the run failed; the row says `error`)."""
    val = ((run.result or {}).get("metrics") or {}).get("val_bpb")
    ok = run.state == "succeeded" and finite(val)
    row = {"run_id": run.name, "status": "baseline" if ok else "error", "job_id": run.job_id,
           "campaign": "", "experiment_id": "baseline", "worker_id": run.worker,
           "hypothesis": "Measure the master as it stands.", "parent_hash": master.hash,
           "candidate_hash": master.hash, "semantic_hash": master.semantic_hash,
           "comment": "" if ok else ((run.result or {}).get("reason") or run.message),
           "reason": "" if ok else ((run.result or {}).get("reason_code") or "BaselineFailed")}
    metrics = (run.result or {}).get("metrics") or {}
    for k in FIGURE_COLUMNS:  # the ledger's metric columns; None (not measured): empty
        if k in metrics:
            row[k] = "" if metrics[k] is None else str(metrics[k])
    row[figures.COLUMN] = _own_columns(set(figures.of_result(run.result, metrics)), row)
    return row, (val if ok else None)
