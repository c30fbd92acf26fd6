"""Does the lab promote real effects, and only those? The promotion policy against known truth.

The real local controller (LocalLab: the engine, the pre-run checks in git, the slot book,
the rebase before start, follow-ups, confirm runs, the compare-and-swap on master.json)
runs labs whose backend is a stand-in with a known answer: a candidate's val_bpb is

    BASE - (sum of the true gains of the changes it holds) + Gaussian noise (sigma)

The lab's surface is a synthetic train.py of independent switches, `EFFECT_07 = 0`, far
enough apart that any two changes rebase onto each other cleanly; experiment i sets its
switch to 1. The lab is configured as a user would: `minDelta: auto` (its noise measured
by the controller's own repeat runs of the master), `confirmRuns`, 4 slots, and all of a
trial's experiments applied at once, so about 20 are in flight together. `--confirm-runs
unsaid --noise-runs 3` is the lab `autolab init` writes (confirm runs for wins beyond the
margin only); `--confirm-runs 0` lets one run decide (the policy before the thirteenth
session), which is what an agent mining the noise with no-op variants plays against.

Three kinds of trial:
  noise   every change has no effect: each promotion is a false one
  gain    every change is a true gain of GAIN_SIGMAS * sigma (cumulative: all can land)
  mixed   a quarter are true gains, the rest nothing

Per trial it checks that the master's history is linear: each master's parent is the one
before it, and each master's program holds every switch of the one before it (a master is
never replaced by a program that lacks it). It prints the promoted share per kind, the runs
spent per decision, and the wall time.

    .venv/bin/python bench/perf/promotion_bench.py [--trials 10] [--per-trial 20] [--seed 1]
        [--confirm-runs 5|unsaid] [--noise-runs 10] [--gain-sigmas 3] [--kinds noise,gain,mixed]
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from controller.cli.lab import init_lab  # noqa: E402
from controller.core.reconcile import RunObservation  # noqa: E402
from controller.local import LAB_FILE, LocalLab  # noqa: E402

SIGMA = 0.01          # run-to-run noise of the stand-in backend (val_bpb)
BASE = 1.0            # the seed master's true val_bpb
GAIN_SIGMAS = 3.0     # a true gain, in sigmas
SLOTS = 4
CONFIRM_RUNS = 5      # promotion.confirmRuns of the bench's labs
NOISE_RUNS = 10       # promotion.noiseRuns: the repeat runs that measure sigma
SWITCHES = 40         # switches in the synthetic surface (the most experiments per trial)
GAP = 8               # comment lines between two switches: hunks never touch


def surface() -> str:
    lines = ['"""A synthetic surface: independent switches, each worth a known gain."""', ""]
    for i in range(SWITCHES):
        lines.append(f"EFFECT_{i:02d} = 0")
        lines += [f"# gap {i}.{k}" for k in range(GAP)]
    return "\n".join(lines) + "\n"


def switches_on(source: str) -> set[int]:
    return {int(m) for m in re.findall(r"^EFFECT_(\d+) = 1$", source, re.M)}


class TruthBackend:
    """A backend with a known answer: true gains of the switches on, plus Gaussian noise.

    A run is "running" for 0-2 observations after its submit (so runs overlap and finish in
    an order of their own), then succeeded.
    """

    name = "local"

    def __init__(self, rng: random.Random, gains: dict[int, float]):
        self.rng = rng
        self.gains = gains
        self.runs: dict[str, list] = {}   # run -> [observations left running, val_bpb]
        self.submitted: list[str] = []

    def submit(self, req) -> RunObservation:
        if req.run not in self.runs:
            on = switches_on(req.candidate_source)
            val = BASE - sum(self.gains.get(i, 0.0) for i in on) + self.rng.gauss(0.0, SIGMA)
            self.runs[req.run] = [self.rng.randint(0, 2), val]
            self.submitted.append(req.run)
        return self.observe(req.run)

    def observe(self, run: str) -> RunObservation:
        r = self.runs.get(run)
        if r is None:
            return RunObservation(run, "missing")
        if r[0] > 0:
            r[0] -= 1
            return RunObservation(run, "running")
        return RunObservation(run, "succeeded", result={"metrics": {"val_bpb": r[1]}})

    def cancel(self, run: str) -> RunObservation:
        return RunObservation(run, "cancelled")

    def cleanup(self, run: str) -> None:
        self.runs.pop(run, None)  # the engine never looks at a run again once it is cleaned up

    def leftovers(self, run: str) -> bool:
        return run in self.runs

    def sandbox_problem(self) -> str | None:
        return None


@dataclass
class Trial:
    kind: str
    true: list[int] = field(default_factory=list)      # experiments with a true gain
    null: list[int] = field(default_factory=list)      # experiments with none
    promoted: set[int] = field(default_factory=set)
    outcomes: dict[str, tuple] = field(default_factory=dict)
    runs: int = 0               # experiment runs (first runs, follow-ups, confirm runs)
    confirmed: int = 0          # experiments that went to confirm runs (a first run won)
    decisions: int = 0          # experiments that reached a verdict
    linear: bool = True
    why: str = ""
    seconds: float = 0.0


def make_lab(root: Path, confirm_runs: int | None, noise_runs: int) -> LocalLab:
    lab = init_lab(root, profile="tiny", data="synthetic", budget=5)
    (root / lab.lab.surface).write_text(surface())
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost",
           "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["commit", "-qam", "A synthetic surface of switches"], cwd=root,
                   check=True)
    lab.repo.seed_master(lab.repo.git("rev-parse", "HEAD").stdout.strip())
    doc = yaml.safe_load((root / LAB_FILE).read_text())
    doc["spec"]["capacity"] = {"gpuSlots": SLOTS}
    doc["spec"]["promotion"] = {"minDelta": "auto", "noiseRuns": noise_runs}
    if confirm_runs is not None:
        doc["spec"]["promotion"]["confirmRuns"] = confirm_runs
    (root / LAB_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
    return LocalLab(root)


def spec(lab: LocalLab, i: int) -> dict:
    src = lab.repo.master_source()
    new = src.replace(f"EFFECT_{i:02d} = 0\n", f"EFFECT_{i:02d} = 1\n", 1)
    diff = "".join(difflib.unified_diff(src.splitlines(True), new.splitlines(True),
                                        "a/train.py", "b/train.py"))
    return {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
            "metadata": {"name": f"switch-{i:02d}"},
            "spec": {"hypothesis": f"Switch {i} on.", "parent": lab.repo.master().hash[:12],
                     "diff": diff}}


def check_linear(lab: LocalLab) -> str:
    """'' when every master holds the one before it; else what broke."""
    history = lab.repo.master_doc()["history"]
    for prev, cur in zip(history, history[1:]):
        if cur.get("parent") != prev["hash"]:
            return f"{cur.get('experiment')}'s parent {str(cur.get('parent'))[:12]} is not " \
                   f"the master before it {prev['hash'][:12]}"
        lost = switches_on(lab.repo.source_of(prev["commit"])) - \
            switches_on(lab.repo.source_of(cur["commit"]))
        if lost:
            return f"{cur.get('experiment')} dropped switch(es) {sorted(lost)}"
        ancestor = lab.repo.git("merge-base", "--is-ancestor", prev["commit"], cur["commit"],
                                check=False)
        if ancestor.returncode != 0:
            return f"{cur.get('experiment')}'s commit does not descend from the master before it"
    return ""


def run_trial(kind: str, n: int, rng: random.Random, base: Path, index: int,
              a: argparse.Namespace) -> Trial:
    t = Trial(kind)
    started = time.time()
    ids = list(range(n))
    if kind == "gain":
        t.true = ids
    elif kind == "noise":
        t.null = ids
    else:
        t.true = ids[: max(1, n // 4)]
        t.null = ids[len(t.true):]
    gains = {i: a.gain_sigmas * SIGMA for i in t.true}
    lab = make_lab(base / f"{kind}-{index}", a.confirm_runs, a.noise_runs)
    backend = TruthBackend(rng, gains)
    lab.backends["local"] = backend
    for i in ids:
        lab.apply_file(spec(lab, i), "bench")
    summary = lab.step()
    for _ in range(20000):
        if summary.done:
            break
        summary = lab.step()
    else:
        raise RuntimeError(f"{kind} trial {index} did not settle")
    for name, st, _ in summary.rows:
        i = int(name.split("-")[1])
        t.outcomes[name] = (st.get("phase"), st.get("reason"), st.get("outcome"))
        if st.get("outcome") == "Promoted":
            t.promoted.add(i)
        if st.get("phase") == "Succeeded":
            t.decisions += 1
    t.runs = sum(1 for r in backend.submitted if r.startswith("exp-"))
    t.confirmed = len({r.rsplit("-", 2)[0] for r in backend.submitted if r.endswith("-c1")})
    t.why = check_linear(lab)
    t.linear = not t.why
    t.seconds = time.time() - started
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10, help="trials per kind")
    ap.add_argument("--per-trial", type=int, default=20, help="experiments in flight per trial")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kinds", default="noise,gain,mixed")
    ap.add_argument("--confirm-runs", default=str(CONFIRM_RUNS),
                    help="promotion.confirmRuns of the labs, or 'unsaid' (the default lab's)")
    ap.add_argument("--noise-runs", type=int, default=NOISE_RUNS, help="promotion.noiseRuns")
    ap.add_argument("--gain-sigmas", type=float, default=GAIN_SIGMAS,
                    help="a true gain, in sigmas")
    ap.add_argument("--no-goals", action="store_true",
                    help="print the figures without judging them against the goals below")
    a = ap.parse_args()
    a.confirm_runs = None if a.confirm_runs == "unsaid" else int(a.confirm_runs)
    if a.per_trial > SWITCHES:
        ap.error(f"--per-trial: at most {SWITCHES}")
    os.environ["AUTOLAB_GPUS"] = ",".join(str(i) for i in range(SLOTS))
    os.environ["AUTOLAB_TRACKING"] = "0"
    rng = random.Random(a.seed)
    print(f"promotion bench: sigma {SIGMA}, true gain {a.gain_sigmas:g} sigma, {SLOTS} slots, "
          f"{a.per_trial} experiments in flight per trial, minDelta auto ({a.noise_runs} noise "
          f"runs), confirmRuns {'unsaid' if a.confirm_runs is None else a.confirm_runs}, "
          f"seed {a.seed}", flush=True)
    results: dict[str, list[Trial]] = {}
    with tempfile.TemporaryDirectory(prefix="autolab-promotion-") as tmp:
        for kind in a.kinds.split(","):
            for k in range(a.trials):
                t = run_trial(kind, a.per_trial, rng, Path(tmp), k, a)
                results.setdefault(kind, []).append(t)
                print(f"  {kind} trial {k}: promoted {len(t.promoted & set(t.true))}/"
                      f"{len(t.true)} true, {len(t.promoted & set(t.null))}/{len(t.null)} "
                      f"null; {t.runs} runs, {t.confirmed} confirmed; linear {'yes' if t.linear else 'NO: ' + t.why}; "
                      f"{t.seconds:.1f} s", flush=True)
    print()
    print(f"{'kind':7} {'experiments':>11} {'true promoted':>14} {'null promoted':>14} "
          f"{'runs/decision':>14} {'confirmed':>10} {'linear':>7}")
    ok = True
    for kind, trials in results.items():
        true = sum(len(t.true) for t in trials)
        null = sum(len(t.null) for t in trials)
        tp = sum(len(t.promoted & set(t.true)) for t in trials)
        fp = sum(len(t.promoted & set(t.null)) for t in trials)
        runs = sum(t.runs for t in trials)
        decisions = sum(t.decisions for t in trials)
        linear = sum(t.linear for t in trials)
        share = lambda a_, b_: f"{a_}/{b_} {100 * a_ / b_:.1f}%" if b_ else "-"  # noqa: E731
        print(f"{kind:7} {true + null:>11} {share(tp, true):>14} {share(fp, null):>14} "
              f"{runs / max(1, decisions):>14.2f} {sum(t.confirmed for t in trials):>10} "
              f"{linear:>3}/{len(trials)}")
        ok &= linear == len(trials)
        if null and not a.no_goals:
            ok &= fp <= 0.05 * null
        if true and kind == "gain" and not a.no_goals:
            ok &= tp >= 0.95 * true
    reasons: dict[str, int] = {}
    for trials in results.values():
        for t in trials:
            for name, (phase, reason, outcome) in t.outcomes.items():
                reasons[f"{phase}/{reason}"] = reasons.get(f"{phase}/{reason}", 0) + 1
    print("verdicts:", ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    print("PASS" if ok else "FAIL", "(every history linear)" if a.no_goals else
          "(null promoted <= 5 %, gain promoted >= 95 %, every history linear)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
