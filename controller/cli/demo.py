"""`autolab demo`: a whole lab on this machine, in minutes, with no GPU and no cluster.

It builds a lab in a temporary directory (tiny profile, synthetic data),
applies specs that meet every outcome a user will see, and runs the same
controller loop as `autolab run`:

  wave 1, written against the seed master:
    improve-lr          a 100x higher lm_head learning rate -> Succeeded, Promoted
                        (the demo's seed has an lm_head learning rate a hundred
                        times too low, so the improvement does not hang on noise)
    regress-capped      logits soft-capped at 0.5           -> Succeeded, Rejected
                        (rebased onto improve-lr before it starts; no softmax over
                        logits within +-0.5 gets confident, so the regression does
                        not hang on how many steps a loaded CPU allows: freezing
                        the block matrices did, and sometimes won)
    repeat-improve      improve-lr's diff again             -> Duplicate (no run)
    repeat-commented    improve-lr plus a comment           -> Duplicate (AST hash)
    touch-prepare       edits the fixed harness             -> Invalid (no run)
  wave 2, still written against the seed master, after improve-lr moved it:
    stale-warmdown      edits other lines                   -> rebased, then run
    stale-conflict      edits the line improve-lr changed   -> Conflict

Then it prints the table, the ledger and the master.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from controller.cli.output import activate_hint, autolab_command
from controller.core.spec import API_VERSION
from controller.local import LAB_FILE, LocalLab


def _diff(old: str, new: str, path: str = "train.py") -> str:
    out = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                       f"a/{path}", f"b/{path}"))
    if not out:
        raise RuntimeError(f"demo edit changed nothing in {path}; bench/train.py moved on?")
    return out


def _edit(source: str, old: str, new: str) -> str:
    if old not in source:
        raise RuntimeError(f"demo: {old!r} not found in the master's train.py")
    return source.replace(old, new, 1)


def _spec(name: str, campaign: str, hypothesis: str, parent: str, diff: str) -> dict:
    return {"apiVersion": API_VERSION, "kind": "Experiment", "metadata": {"name": name},
            "spec": {"campaign": campaign, "hypothesis": hypothesis, "parent": parent[:12],
                     "diff": diff}}


LR_LINE = "    UNEMBEDDING_LR = 0.02"  # the tiny profile's lm_head learning rate
SEED_LR_LINE = "    UNEMBEDDING_LR = 0.0002"
CAP_FROM, CAP_TO = "LOGIT_SOFTCAP = 15.0 ", "LOGIT_SOFTCAP = 0.5 "
WARMDOWN_LINE = "WARMDOWN_RATIO = 0.5"


def run_demo(keep: bool = False, directory: str | None = None) -> int:
    from controller.cli.lab import cmd_get, cmd_ledger, cmd_master, run_loop
    from controller.lab.init import default_max_pairs
    from controller.local import init_lab

    started = time.time()
    base = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="autolab-demo-"))
    root = base / "lab"
    print(f"== autolab demo: a tiny lab in {root} (CPU, synthetic data)", flush=True)
    lab = init_lab(root, profile="tiny", data="synthetic",
                   max_pairs=default_max_pairs("tiny", None))
    # Tiny runs last seconds, so their val_bpb is noisy; the demo starts from a master with a
    # tiny lm_head learning rate a hundred times too low, so that its "improvement" improves
    # on any machine.
    handicapped = _edit(lab.repo.master_source(), LR_LINE, SEED_LR_LINE)
    (root / lab.lab.surface).write_text(handicapped)
    git = ["git", "-c", "user.name=autolab", "-c", "user.email=autolab@localhost"]
    subprocess.run(git + ["commit", "-qam", "Demo seed: an lm_head learning rate a hundred times too low"],
                   cwd=root, check=True)
    lab.repo.seed_master(lab.repo.git("rev-parse", "HEAD").stdout.strip())
    # One run at a time, even on a machine with GPUs: the story below depends on the order.
    doc = yaml.safe_load((root / LAB_FILE).read_text())
    doc["spec"]["capacity"] = {"gpuSlots": 1}
    # A tiny run's val_bpb moves by about 0.015 from run to run: a win must be larger than that
    # to be one (a real lab measures its noise: `autolab noise`, minDelta auto).
    doc["spec"]["promotion"] = {"minDelta": 0.02}
    (root / LAB_FILE).write_text(yaml.safe_dump(doc, sort_keys=False))
    lab = LocalLab(root)
    seed = lab.repo.master()
    src = lab.repo.master_source()
    prepare_src = (root / "bench" / "prepare.py").read_text()
    better = _edit(src, SEED_LR_LINE, LR_LINE)
    wave1 = [
        _spec("improve-lr", "learning-rate", "A hundred times higher lm_head learning rate "
              "lets the output layer learn within the budget.", seed.hash, _diff(src, better)),
        _spec("regress-capped", "logits", "Soft-capping the logits at 0.5 should regress.",
              seed.hash, _diff(src, _edit(src, CAP_FROM, CAP_TO))),
        _spec("repeat-improve", "learning-rate", "The same higher learning rate, proposed again.",
              seed.hash, _diff(src, better)),
        _spec("repeat-commented", "learning-rate", "The higher learning rate with a new comment.",
              seed.hash, _diff(src, _edit(better, LR_LINE + "\n",
                                          LR_LINE + "  # raised for the demo\n"))),
        _spec("touch-prepare", "harness", "Evaluate on fewer tokens.", seed.hash,
              _diff(prepare_src, prepare_src.replace("CACHE_FORMAT = 1", "CACHE_FORMAT = 2", 1),
                    "prepare.py")),
    ]
    for doc in wave1:
        print(f"experiment.autolab.dev/{doc['metadata']['name']} "
              f"{lab.apply_file(doc, 'demo')}", flush=True)
    print("== autolab run (the master's baseline is measured first)", flush=True)
    if run_loop(lab, interval=0.5) != 0:
        return 1
    moved = lab.repo.master()
    if moved.hash == seed.hash:
        print("note: improve-lr did not beat the master this time, so wave 2 is not stale",
              flush=True)
    wave2 = [
        _spec("stale-warmdown", "schedule", "A shorter warmdown keeps the peak LR longer.",
              seed.hash, _diff(src, _edit(src, WARMDOWN_LINE, "WARMDOWN_RATIO = 0.3"))),
        _spec("stale-conflict", "learning-rate", "A 50x higher lm_head learning rate.", seed.hash,
              _diff(src, _edit(src, SEED_LR_LINE, "    UNEMBEDDING_LR = 0.01"))),
    ]
    print(f"== wave 2: written against the seed master {seed.hash[:12]}; the master is now "
          f"{moved.hash[:12]}", flush=True)
    for doc in wave2:
        print(f"experiment.autolab.dev/{doc['metadata']['name']} "
              f"{lab.apply_file(doc, 'demo')}", flush=True)
    if run_loop(lab, interval=0.5) != 0:
        return 1

    class A:  # the CLI commands' arguments
        lab = str(root)
        name = None
        output = "wide"
        selector = sort_by = None
        watch = False

    print("\n== autolab get -o wide")
    cmd_get(A)
    print("\n== autolab ledger")
    A.output = "table"
    cmd_ledger(A)
    print("\n== autolab master")
    A.output = "text"
    cmd_master(A)
    print(f"\ndemo finished in {time.time() - started:.0f} s")
    if keep or directory:
        print(f"the lab stays in {root}: try `cd {root} && {autolab_command()} get -o wide`"
              f"{activate_hint()}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    sys.stdout.flush()
    return 0


def cmd_demo(a) -> int:
    return run_demo(keep=a.keep, directory=a.dir)
