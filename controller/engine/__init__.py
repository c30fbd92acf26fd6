"""The engine: every decision about a lab's experiments, for both front ends.

    seams.py     what a front end gives it: StatusStore, MasterOfRecord, EventSink (Protocols)
    engine.py    the Engine: a pass over one experiment (observe, reconcile(), carry out each
                 intent with its own method), the slot book, the checks, the baseline
    campaign.py  the lab's places (their secret seeds) and its tests (their levels)
    noise.py     `autolab noise`: the master at places 1..N, and once more at each

The pure core (`controller.core.reconcile`) says what an experiment's status
should be and which effects move it there. The engine is the one place that
observes the world for it and carries those effects out, for the local loop
and the operator alike:

    front end (a file changed, a kopf event, a timer)
        -> Engine.reconcile(observed): the experiment as the front end read it
             observe the rest: its run (a backend), the master
                      (MasterOfRecord), the ledger, what its check left
             -> reconcile(World) -> Decision(status, intents, events, finalized)
             -> tell the events, write the status, carry out the intents:
                materialise (checks, duplicate lookup), acquire-slot (the slot
                book), submit / cancel (a backend), promote (compare-and-swap
                on the master), record (one ledger row, then the research notes
                and Trackio), cleanup
             again until no intent is left
        -> Engine.baseline(): measure a master nobody has measured

What differs between the front ends sits behind three small seams, and only
there: where an experiment and its status live (`StatusStore`: JSON files
under `.autolab/status`, or the custom resource's status), where the master
lives (`MasterOfRecord`: `research/live/master.json`, or the master
ConfigMap), and how events are told (`EventSink`: a JSONL file per
experiment, or Kubernetes Events).

The policies, decided here once:

- Baseline. A master with no val_bpb is measured before any experiment runs
  (the core waits; no slot is handed out). Each attempt is its own run,
  `baseline-<lab>-<hash>-<n>`, with its own ledger row; a failed attempt is
  tried again, up to BASELINE_ATTEMPTS per engine (per controller start), then
  the lab waits for a person: the local loop stops and says so, the operator
  marks the Lab not Ready. The baseline asks for what a default experiment
  asks (one GPU), so the master and its candidates are measured alike.
- Measured. A run measured its candidate when its ledger row is `succeeded`,
  `failed` or `baseline` (`controller.lab.ledger.MEASURED`); a repeat of a
  measured candidate, of the master, or of a candidate in flight is a
  Duplicate and spends no run.
- The spec that runs is the spec that was checked: a copy is kept when the
  checks pass (`.autolab/specs/<key>.json`) and used from then on; later edits
  are reported (SpecChangeIgnored) and ignored.
- Slots. One slot book per lab, filled from the statuses as written; the core
  asks for a slot (`acquire-slot`) only when it would submit, and the book
  answers by priority, then creation time (when the user applied it; the
  front end's `Observed.created`), with a decision's pair runs one experiment
  at a time and a first run never waiting behind more than
  `slots.FIRST_RUN_EVERY` of them. Capacity is the backend's: the
  machine's GPUs (local), `gpuSlots` jobs at once (Hugging Face; one when
  unset), `gpuSlots` or the cluster's scheduler (Kubernetes).
- Checks at once. A front end with a batch of new specs starts their checks
  together on the check pool (`precheck`; the operator, whose handlers run
  passes of many experiments at once, sends every check there); each pass
  takes its result, then looks up duplicates and claims its candidate under
  the engine's lock, in the front end's order, against the master it was
  checked on (else it is checked again).
- Cleanup. After the ledger row: the candidate's marker goes (the branch of
  a run stays: it is the experiment DAG) and the backend's objects go
  (`Backend.cleanup`); the status goes only when both are done.
- Cumulative masters (the rules are the core's; the engine carries them out).
  A queued candidate whose master moved is materialised again onto the
  current master right before its submit (the slot it was granted is kept
  meanwhile). A run that ends mid-life (a follow-up's first run, a pair
  run) gets its own ledger row at once and its backend objects go
  (`cleanup-run`). A pair run of the master runs the parent's source, and
  its value is kept on the master (`set-place`) for every later candidate.
- Places and tests. A run's harness seed is its place's, drawn from the
  lab's secret (`.autolab/state/noise.key`, which no run can read;
  `controller.core.noise.place_seed`): the core names places, never seeds.
  Which test against a master an experiment's decision is (its level) is
  counted here when its first run is submitted: the experiments that began
  one against that master, kept in `.autolab/state/tests/<master>.json`.
- Noise. `autolab noise` (`controller.engine.noise`) runs the master at places 1..N
  (kept on the master, so candidates reuse them) and once more at each (the
  GPU's own run-to-run noise), and writes `research/live/noise.json` for that
  master: the spread across seeds, the spread of paired differences and the
  smallest gain the lab detects. No decision reads it: a decision's spread
  is its own pairs'.
"""

from controller.engine.engine import (BASELINE_GPUS, MAX_STEPS, BaselineFailed, BaselineState,
                                      Engine, capacity)
from controller.engine.noise import measure_noise, noise_record, noise_summary
from controller.engine.seams import (DEFAULT_HOOKS, EventSink, Hook, MasterOfRecord, Observed,
                                     StatusStore)

__all__ = ["BASELINE_GPUS", "DEFAULT_HOOKS", "MAX_STEPS", "BaselineFailed", "BaselineState",
           "Engine", "EventSink", "Hook", "MasterOfRecord", "Observed", "StatusStore",
           "capacity", "measure_noise", "noise_record", "noise_summary"]
