"""`autolab noise`: the master at places 1..N, and once more at each.

The master's run at place i (`noise-<lab>-<hash>-p<i>`) is kept on the master: the
candidates that reach place i are compared with it and run nothing for it. The repeat
(`noise-<lab>-<hash>-r<i>`, the same program on the same seed) shows the GPU's own
run-to-run noise: the spread of a paired difference when nothing changed. What it measured
goes to `research/live/noise.json` for that master: the spread across seeds, the spread of
paired differences and the smallest gain the lab detects. No decision reads it: a
decision's spread is its own pairs'.
"""

from __future__ import annotations

import json

from controller.core.intents import Event
from controller.core.noise import ALPHA, detectable_gain, mean, spread
from controller.core.reconcile import Master, master_run_row, noise_run_name
from controller.engine.engine import BaselineState, Engine
from controller.lab.clock import utcnow
from controller.lab.files import atomic_write


def noise_record(engine: Engine) -> dict | None:
    """What `autolab noise` measured, if it measured the current master at this profile and
    budget (a record of another master says nothing of this one's spread)."""
    try:
        doc = json.loads(engine.paths.noise_file.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("profile") != engine.lab.profile \
            or doc.get("budgetSeconds") != engine.lab.budget_seconds \
            or doc.get("master") != engine.master.master().hash \
            or not isinstance(doc.get("acrossSeeds"), (int, float)):
        return None
    return doc


def measure_noise(engine: Engine, runs: int) -> BaselineState:
    """One step of `autolab noise`: the master at places 1..`runs`, and once more at each.

    The master's run at place i (`noise-<lab>-<hash>-p<i>`) is kept on the master: the
    candidates that reach place i are compared with it and run nothing for it. The repeat
    (`noise-<lab>-<hash>-r<i>`, the same program on the same seed) shows the GPU's own
    run-to-run noise: the spread of a paired difference when nothing changed. A run that
    failed is not replaced (its row says error; `autolab noise` says so and stops). Names
    are deterministic, so a step after a restart adopts the runs in flight, and asking
    again reads the ledger instead of running.
    """
    m = engine.master.master()
    if m.place(1) is None:
        return BaselineState(None, "waiting", "the master's baseline comes first")
    rows = {r.get("run_id"): r for r in engine.ledger.rows()}
    backend = engine.backend(engine.default_backend)
    state = BaselineState(None, "waiting")
    wanted = [(p, "p") for p in range(1, runs + 1) if m.places.get(p) is None] + \
        [(p, "r") for p in range(1, runs + 1)]
    for place, kind in wanted:
        name = noise_run_name(engine.lab_name, m, place, kind)
        row = rows.get(name)
        if row is not None:
            if row.get("status") == "error":
                return BaselineState(name, "failed", f"noise run {name} failed: "
                                     f"{row.get('comment') or 'see its log'}")
            if kind == "p":  # recorded, but the master did not take it (a crash between)
                with engine.lock:
                    engine.master.set_place(m.hash, place, float(row["val_bpb"]))
            continue
        obs = backend.observe(name)
        if obs.state == "missing":
            slot = engine.book.hold(name)
            if slot is None:
                continue  # every slot is busy: a later step submits it
            backend.submit(engine.master_request(m, name, slot, engine.campaign.place_seed(place)))
            state = BaselineState(name, "running")
            continue
        if obs.state in ("queued", "running"):
            engine.book.hold(name, backend.slot_of(name))
            state = BaselineState(name, "running")
            continue
        row, val = master_run_row(m, obs)
        if kind == "r" and row["status"] == "baseline":
            row["status"] = "noise"
        row.update(experiment_id="noise", backend=engine.default_backend,
                   hypothesis=f"The master at place {place}" + (
                       ", again: the GPU's own noise." if kind == "r" else "."))
        engine.record_row(row, None, None)
        if kind == "p" and val is not None:
            with engine.lock:
                engine.master.set_place(m.hash, place, val)
        backend.cleanup(name)
        engine.book.release(name)
        state = BaselineState(name, "running")  # the next step reads its row
    if state.state == "running":
        return state
    m = engine.master.master()
    rows = {r.get("run_id"): r for r in engine.ledger.rows()}
    places = [m.places.get(p) for p in range(1, runs + 1)]
    repeats = [rows.get(noise_run_name(engine.lab_name, m, p, "r"), {}).get("val_bpb")
               for p in range(1, runs + 1)]
    if any(v is None for v in places) or any(v in (None, "") for v in repeats):
        return state
    return _noise_measured(engine, m, [float(v) for v in places], [float(v) for v in repeats])


def _noise_measured(engine: Engine, m: Master, places: list[float],
                    repeats: list[float]) -> BaselineState:
    across = spread(places)
    paired = spread([r - p for r, p in zip(repeats, places)])
    if across is None or paired is None:
        return BaselineState(None, "failed", "the noise needs at least two places")
    cap = engine.lab.pairs_cap
    factor = detectable_gain(ALPHA, cap)
    doc = {"master": m.hash, "experiment": m.experiment, "profile": engine.lab.profile,
           "budgetSeconds": engine.lab.budget_seconds, "places": places, "repeats": repeats,
           "acrossSeeds": round(across, 6), "paired": round(paired, 6),
           "mean": round(mean(places), 6), "cap": cap,
           "detectableSds": factor, "detectable": round(factor * paired, 6),
           "measuredAt": utcnow()}
    old = noise_record(engine)
    if old is None or old.get("places") != places or old.get("repeats") != repeats:
        atomic_write(engine.paths.noise_file, json.dumps(doc, indent=2) + "\n")
        engine.events.lab(Event("Normal", "NoiseMeasured", noise_summary(doc)))
        engine.events.lab_changed()
    return BaselineState(None, "measured", noise_summary(doc))


def noise_summary(doc: dict) -> str:
    """One line of what `autolab noise` measured, and on which master."""
    return (f"master {str(doc.get('master'))[:12]} ({doc.get('experiment') or 'seed'}): across "
            f"{len(doc.get('places') or [])} seeds sd {doc.get('acrossSeeds')}, paired (the same "
            f"seed twice) sd {doc.get('paired')}; the first test against it promotes a gain of "
            f"{doc.get('detectable')} ({doc.get('detectableSds')} paired sds) 9 times in 10 "
            f"within {doc.get('cap')} pairs")
