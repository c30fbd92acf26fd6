"""Does the lab promote real gains, and only those? The promotion policy against known truth.

The real local controller (LocalLab: the engine, the pre-run checks in git, the slot book, the
rebase before start, follow-ups, pairs on the lab's secret seeds, the compare-and-swap on
master.json) runs labs whose backend is a stand-in with a known answer. A run of a program on
harness seed s measures

    BASE + data(s) + init(SEED line, s) - (true gains of the switches it holds) + gpu noise

- data(s): shared by every program at that seed (the data order), sd DATA;
- init(SEED line, s): shared by programs with the same SEED line; a `SEED` change draws it
  again, sd INIT;
- gpu noise: each run's own, sd GPU.

The three were fitted to runs of `bench/run.py` on an H100 (default profile, 45-s budget, the
mkcorpus corpus, the sandbox on; ../shared/notes/gpu-noise.md): the master across seeds sd
0.0048, the same seed twice 0.0014 apart, a SEED-only variant's paired differences sd 0.0050,
a real change's 0.0011. So GPU = 0.0014 / sqrt(2) = 0.001, INIT = sqrt(0.0050^2 / 2 - GPU^2) =
0.0034 and DATA = sqrt(0.0048^2 - INIT^2 - GPU^2) = 0.0032; a change that does not touch SEED
pairs with sd PAIRED = GPU * sqrt(2) = 0.0014.

The lab's surface is a synthetic train.py of independent switches, `EFFECT_07 = 0`, far
enough apart that any two changes rebase onto each other cleanly. A switch is a true gain, a
loser, a dead constant (no effect: a new program that runs the same) or a SEED variant (no
effect on average, a new initialisation on every seed). The labs are `autolab init`'s:
`minDelta: auto`, pairs up to the cap, and SLOTS slots.

Rows (each prints runs per decision, counting the master's runs at places it had no value for):
  noop     dead constants, one at a time against the master: promoted share
  seed     SEED variants, one at a time: promoted share
  gain     true gains of GAIN_SDS paired sds, one at a time: promoted share, runs per win
  loser    losers worse by GAIN_SDS paired sds: runs per decision
  campaign 20 experiments (5 true gains, 15 dead constants) applied at once on SLOTS slots:
           trials whose final master holds all 5 gains, and a linear history
  handicap a master whose spread falls 4x once a handicap is fixed; the fix, then a true gain
           of GAIN_SDS of the fixed program's paired sd: promoted share of that gain

    .venv/bin/python bench/perf/promotion_bench.py [--rows noop,seed,gain,loser,campaign,handicap]
        [--decisions 1000] [--trials 100] [--seed 1]
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from controller.backends import Backend  # noqa: E402
from controller.core.reconcile import RunObservation  # noqa: E402
from controller.local import LAB_FILE, LocalLab, init_lab  # noqa: E402

BASE = 1.0            # the seed master's true val_bpb
GPU = 0.0010          # a run's own noise (the same seed twice differ by GPU * sqrt(2))
INIT = 0.0034         # the initialisation's part, drawn again by a SEED change
DATA = 0.0032         # the data order's part, shared by every program at a seed
PAIRED = GPU * math.sqrt(2)  # the sd of a paired difference for a change that keeps SEED
GAIN_SDS = 3.0        # a true gain (and a clear loss), in paired sds
HANDICAP = 4.0        # how much wider the handicapped master spreads
SLOTS = 4
SWITCHES = 40         # switches in the synthetic surface
GAP = 8               # comment lines between two switches: hunks never touch
RUN_SECONDS = 300 + 20  # a 300-s run and the harness's ~20 s around it (docs/results.md)


def surface() -> str:
    lines = ['"""A synthetic surface: independent switches, each worth a known gain."""', "",
             "SEED = 42"]
    for i in range(SWITCHES):
        lines.append(f"EFFECT_{i:02d} = 0")
        lines += [f"# gap {i}.{k}" for k in range(GAP)]
    return "\n".join(lines) + "\n"


def switches_on(source: str) -> set[int]:
    return {int(m) for m in re.findall(r"^EFFECT_(\d+) = 1$", source, re.M)}


class StandIn(Backend):
    """A backend with a known answer (see the module docstring). Runs finish on the next
    observation, so runs overlap and finish in an order of their own."""

    name = "local"

    def __init__(self, rng: random.Random, gains: dict[int, float], seed_switches: set[int],
                 handicap: int | None = None):
        self.rng = rng
        self.gains = gains
        self.seed_switches = seed_switches
        self.handicap = handicap      # a switch that, while off, spreads the program HANDICAP x
        self.parts: dict = {}
        self.runs: dict[str, list] = {}
        self.submitted: list[str] = []

    def part(self, key, sd: float) -> float:
        if key not in self.parts:
            self.parts[key] = self.rng.gauss(0.0, sd)
        return self.parts[key]

    def measure(self, source: str, seed: int) -> float:
        on = switches_on(source)
        init_key = tuple(sorted(on & self.seed_switches))  # a SEED change: another init
        noise = self.part(("data", seed), DATA) + self.part(("init", init_key, seed), INIT) \
            + self.rng.gauss(0.0, GPU)
        if self.handicap is not None and self.handicap not in on:
            noise *= HANDICAP
        return BASE - sum(self.gains.get(i, 0.0) for i in on) + noise

    def submit(self, req) -> RunObservation:
        if req.run not in self.runs:
            self.runs[req.run] = [1, round(self.measure(req.candidate_source, req.seed), 6)]
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
        self.runs.pop(run, None)

    def leftovers(self, run: str) -> bool:
        return run in self.runs

    def sandbox_problem(self) -> str | None:
        return None


def make_lab(root: Path) -> LocalLab:
    lab = init_lab(root, profile="tiny", data="synthetic", budget=5)
    (root / lab.lab.surface).write_text(surface())
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost",
           "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["commit", "-qam", "A synthetic surface of switches"], cwd=root,
                   check=True)
    lab.repo.seed_master(lab.repo.git("rev-parse", "HEAD").stdout.strip())
    doc = yaml.safe_load((root / LAB_FILE).read_text())
    doc["spec"]["capacity"] = {"gpuSlots": SLOTS}
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


def settle(lab: LocalLab) -> dict[str, dict]:
    summary = lab.step()
    for _ in range(20000):
        if summary.done:
            return {n: st for n, st, _ in summary.rows}
        summary = lab.step()
    raise RuntimeError("the lab did not settle")


def check_linear(lab: LocalLab) -> str:
    """'' when every master holds the one before it; else what broke."""
    history = lab.repo.master_doc()["history"]
    for prev, cur in zip(history, history[1:]):
        if cur.get("parent") != prev["hash"]:
            return f"{cur.get('experiment')}'s parent is not the master before it"
        lost = switches_on(lab.repo.source_of(prev["commit"])) - \
            switches_on(lab.repo.source_of(cur["commit"]))
        if lost:
            return f"{cur.get('experiment')} dropped switch(es) {sorted(lost)}"
    return ""


def one_at_a_time(kind: str, decisions: int, rng: random.Random, tmp: Path) -> dict:
    """`decisions` experiments of one kind, each applied alone and settled before the next, in
    labs of up to SWITCHES experiments. Each is tested as the first test against its master
    (the lab's count of tests is reset before it: the highest level a decision ever gets)."""
    out = {"decisions": 0, "promoted": 0, "runs": 0, "win_runs": 0, "seconds": 0.0}
    started = time.time()
    labs = 0
    while out["decisions"] < decisions:
        lab = make_lab(tmp / f"{kind}-{labs}")
        labs += 1
        n = min(SWITCHES, decisions - out["decisions"])
        gain = GAIN_SDS * PAIRED
        gains = {i: (gain if kind == "gain" else -gain if kind == "loser" else 0.0)
                 for i in range(n)}
        backend = StandIn(rng, gains, set(range(n)) if kind == "seed" else set())
        lab.backends["local"] = backend
        for i in range(n):
            for f in (lab.paths.state / "tests").glob("*.json"):
                f.unlink()
            before = len(backend.submitted)
            lab.apply_file(spec(lab, i), "bench")
            st = settle(lab)[f"switch-{i:02d}"]
            spent = len(backend.submitted) - before
            out["decisions"] += 1
            out["runs"] += spent
            if st.get("outcome") == "Promoted":
                out["promoted"] += 1
                out["win_runs"] += spent
            if kind != "gain" and st.get("outcome") == "Promoted":
                # a false promotion moved the master: later decisions run on the new one
                pass
    out["seconds"] = time.time() - started
    return out


def campaign(trials: int, rng: random.Random, tmp: Path, per: int = 20, true: int = 5) -> dict:
    """`per` experiments (`true` true gains, the rest dead constants) applied at once."""
    out = {"trials": 0, "all": 0, "linear": 0, "runs": 0, "decisions": 0, "seconds": 0.0,
           "false": 0, "why": ""}
    started = time.time()
    for k in range(trials):
        lab = make_lab(tmp / f"campaign-{k}")
        gains = {i: GAIN_SDS * PAIRED for i in range(true)}
        backend = StandIn(rng, gains, set())
        lab.backends["local"] = backend
        for i in range(per):
            lab.apply_file(spec(lab, i), "bench")
        settle(lab)
        on = switches_on(lab.repo.master_source())
        out["trials"] += 1
        out["all"] += set(range(true)) <= on
        out["false"] += len(on - set(range(true)))
        why = check_linear(lab)
        out["linear"] += not why
        out["why"] = out["why"] or why
        out["runs"] += sum(1 for r in backend.submitted if not r.startswith("baseline-"))
        out["decisions"] += per
    out["seconds"] = time.time() - started
    return out


def handicap(trials: int, rng: random.Random, tmp: Path) -> dict:
    """Switch 0 fixes a handicap (a gain of 60 paired sds; while it is off the program spreads
    HANDICAP times wider); switch 1 is then a true gain of GAIN_SDS of the fixed program's
    paired sd, applied once switch 0 is in."""
    out = {"trials": 0, "fixed": 0, "gain": 0, "seconds": 0.0}
    started = time.time()
    for k in range(trials):
        lab = make_lab(tmp / f"handicap-{k}")
        backend = StandIn(rng, {0: 60 * PAIRED, 1: GAIN_SDS * PAIRED}, set(), handicap=0)
        lab.backends["local"] = backend
        lab.apply_file(spec(lab, 0), "bench")
        fixed = settle(lab)["switch-00"].get("outcome") == "Promoted"
        out["trials"] += 1
        out["fixed"] += fixed
        if fixed:
            lab.apply_file(spec(lab, 1), "bench")
            out["gain"] += settle(lab)["switch-01"].get("outcome") == "Promoted"
    out["seconds"] = time.time() - started
    return out


def sequential(trials: int, rng: random.Random) -> None:
    """The test the lab uses against the alternative we did not take, on normal pairs (no lab):
    the split t (`controller.core.noise.decide`) and a scale-invariant mixture (the Bayes factor
    of a normal prior on the standardised gain, g = 1 and 4, promoted at 1 / alpha; valid under
    optional stopping), both with the same futility stops, at the first test's level."""
    from controller.core.noise import ALPHA, MAX_PAIRS, decide, spread

    def bayes(gains: list[float], g: float) -> str:
        n, m = len(gains), sum(gains) / len(gains)
        if m <= 0:
            return "reject"
        if n < 2:
            return "continue"
        sd = spread(gains) or 1e-12
        t, nu = m / (sd / math.sqrt(n)), n - 1
        if t < 1.0:
            return "reject"
        bf = (1 + n * g) ** -0.5 * ((1 + t * t / (nu * (1 + n * g))) / (1 + t * t / nu)) \
            ** (-(nu + 1) / 2)
        return "promote" if bf >= 1 / ALPHA else ("reject" if n >= MAX_PAIRS else "continue")

    tests = {"split t": lambda gains: decide(gains).decision,
             "mixture g=1": lambda gains: bayes(gains, 1.0),
             "mixture g=4": lambda gains: bayes(gains, 4.0)}
    for delta in (0.0, 1.0, 2.0, GAIN_SDS):
        cells = []
        for name, test in tests.items():
            won = runs = 0
            for _ in range(trials):
                gains: list[float] = []
                while True:
                    gains.append(rng.gauss(delta, 1.0))
                    verdict = test(gains)
                    if verdict != "continue":
                        won += verdict == "promote"
                        runs += len(gains)
                        break
            cells.append(f"{name}: {100 * won / trials:5.1f} % in {runs / trials:.2f} pairs")
        print(f"gain {delta:g} paired sds | " + " | ".join(cells), flush=True)


def core_rows(kind: str, decisions: int, rng: random.Random, per_master: int = 40) -> dict:
    """The same rows as `one_at_a_time`, decided by the core alone: `reconcile()` with the
    stand-in's values, the master's places kept in a dict, and what the engine does for the
    intents (a run, a place kept, a promotion) done here. Thousands of decisions a minute, where
    the real controller (git, files, the slot book) takes about a second each on 2 cores."""
    from controller.core.noise import lord_level
    from controller.core.reconcile import Master, World, reconcile
    from controller.core.spec import ExperimentSpec, LabSpec

    lab_spec = LabSpec(profile="tiny")   # the lab's defaults: minDelta auto
    spec = ExperimentSpec(hypothesis="x", parent="m", diff="--- a/train.py")
    out = {"decisions": 0, "promoted": 0, "runs": 0, "win_runs": 0}
    gain = GAIN_SDS * PAIRED * (1 if kind == "gain" else -1 if kind == "loser" else 0)
    while out["decisions"] < decisions:
        parts: dict = {}
        draw = lambda key, sd: parts.setdefault(key, rng.gauss(0.0, sd))  # noqa: E731
        def value(total_gain: float, init: object, place: int) -> float:
            v = BASE - total_gain + draw(("data", place), DATA) + draw(("init", init, place), INIT)
            return round(v + rng.gauss(0.0, GPU), 6)
        master_gain, master_init, version = 0.0, "seed", 0
        places = {1: value(0.0, "seed", 1)}
        for k in range(min(per_master, decisions - out["decisions"])):
            init = f"seed-{k}" if kind == "seed" else master_init
            master = Master(hash=f"{version:040d}", semantic_hash="s", commit="c",
                            val_bpb=places[1], places=dict(places))
            st: dict = {"phase": "Queued", "parentHash": master.hash, "candidateHash": "c" * 40,
                        "queuedAt": "t", "conditions": []}
            spent, promoted = 0, False
            for _ in range(200):
                # the k-th test after a promotion, at the online FDR control's level
                w = World(name=f"e{k}", spec=spec, lab=lab_spec, master=master, now="t",
                          status=st, slot="0", tries=k + 1, level=lord_level(k + 2, (1,)),
                          entropy=rng.getrandbits(64))
                d = reconcile(w)
                sub = next((i for i in d.intents if i.kind == "submit"), None)
                if sub is not None:
                    spent += 1
                    mine = sub.program == "candidate"
                    val = value(master_gain + (gain if mine else 0.0),
                                init if mine else master_init, sub.place)
                    d = reconcile(World(name=f"e{k}", spec=spec, lab=lab_spec, master=master,
                                        now="t", status=d.status, run=RunObservation(
                                            sub.run, "succeeded",
                                            result={"metrics": {"val_bpb": val}})))
                for i in d.intents:
                    if i.kind == "set-place":
                        places.setdefault(int(i.place), i.val_bpb)
                    if i.kind == "promote":
                        promoted = True
                st = d.status
                master = Master(hash=master.hash, semantic_hash="s", commit="c",
                                val_bpb=places[1], places=dict(places))
                if promoted or st.get("phase") in ("Succeeded", "Failed"):
                    break
            if promoted:
                places = {int(p): v for p, v in next(
                    i for i in d.intents if i.kind == "promote").places.items()}
                master_gain, master_init, version = master_gain + gain, init, version + 1
                out["promoted"] += 1
                out["win_runs"] += spent
            out["decisions"] += 1
            out["runs"] += spent
    return out


def pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / b:.1f} %)" if b else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="noop,seed,gain,loser,campaign,handicap")
    ap.add_argument("--decisions", type=int, default=1000, help="decisions per one-at-a-time row")
    ap.add_argument("--trials", type=int, default=100, help="trials of the campaign and handicap")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--core", action="store_true",
                    help="decide the one-at-a-time rows with the core alone (fast; no lab)")
    ap.add_argument("--sequential", type=int, metavar="TRIALS",
                    help="only compare the split t with a mixture test on normal pairs")
    a = ap.parse_args()
    if a.sequential:
        sequential(a.sequential, random.Random(a.seed))
        return 0
    os.environ["AUTOLAB_GPUS"] = ",".join(str(i) for i in range(SLOTS))
    os.environ["AUTOLAB_TRACKING"] = "0"
    rng = random.Random(a.seed)
    print(f"promotion bench: data sd {DATA}, init sd {INIT}, gpu sd {GPU} (paired sd "
          f"{PAIRED:.4f}); gains and losses of {GAIN_SDS:g} paired sds; {SLOTS} slots; "
          f"the lab's defaults (minDelta auto); seed {a.seed}", flush=True)
    ok = True
    rows = a.rows.split(",")
    with tempfile.TemporaryDirectory(prefix="autolab-promotion-") as tmp:
        for row in rows:
            if row in ("noop", "seed", "gain", "loser"):
                began = time.time()
                r = core_rows(row, a.decisions, rng) if a.core else \
                    one_at_a_time(row, a.decisions, rng, Path(tmp))
                r["seconds"] = time.time() - began
                per = r["runs"] / r["decisions"]
                line = (f"{row:8} promoted {pct(r['promoted'], r['decisions'])}, "
                        f"{per:.2f} runs per decision")
                if row == "gain":
                    line += f", {r['win_runs'] / max(1, r['promoted']):.2f} runs per win"
                    ok &= r["promoted"] >= 0.9 * r["decisions"]
                    ok &= r["win_runs"] / max(1, r["promoted"]) <= 5
                elif row == "noop":
                    ok &= r["promoted"] <= 0.01 * r["decisions"]
                elif row == "seed":
                    ok &= r["promoted"] <= 0.02 * r["decisions"]
                else:
                    ok &= per <= 1.3
                print(f"{line}; {r['seconds']:.0f} s", flush=True)
            elif row == "campaign":
                r = campaign(a.trials, rng, Path(tmp))
                print(f"campaign all 5 gains in the master in {pct(r['all'], r['trials'])} "
                      f"trials, false promotions {r['false']}, linear {r['linear']}/"
                      f"{r['trials']}{' (' + r['why'] + ')' if r['why'] else ''}, "
                      f"{r['runs'] / r['decisions']:.2f} runs per decision; "
                      f"{r['seconds']:.0f} s", flush=True)
                ok &= r["all"] >= 0.9 * r["trials"] and r["linear"] == r["trials"]
            elif row == "handicap":
                r = handicap(a.trials, rng, Path(tmp))
                print(f"handicap fix promoted {pct(r['fixed'], r['trials'])}; the next gain "
                      f"({GAIN_SDS:g} of the fixed program's paired sd) promoted "
                      f"{pct(r['gain'], r['fixed'])}; {r['seconds']:.0f} s", flush=True)
                ok &= r["gain"] >= 0.9 * max(1, r["fixed"])
    print("PASS" if ok else "FAIL", "(noop <= 1 %, seed <= 2 %, gain >= 90 % at <= 5 runs per "
          "win, loser <= 1.3 runs, campaign >= 90 % all gains and linear, handicap >= 90 %)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
