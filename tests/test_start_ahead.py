"""The next run starts up while the one before it on the GPU is evaluated, and trains only after its verdict.

Evaluation needs the GPU far less than training, and a run's start-up (imports, compiling,
warming up) needs it hardly at all; so once a run's candidate is gone and its evaluator holds
the memory it needs (`--handover`), the local backend may start the slot's next run beside it
(`LocalBackend.start_next`, asked by the engine). That run waits at its first batch, its clock
not started (`--gate`), until the submit of exactly the same request takes it over after the
verdict; anything else on the slot stops it. Real harness, tiny CPU profile; AUTOLAB_GPUS=0
stands in for one GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from controller.backends import RunRequest
from controller.backends.local import LocalBackend
from controller.cli.lab import init_lab
from labkit import spec_from_edit
from test_run_phases import BENCH, TRAIN, bench, env_for  # noqa: F401  (the module fixture)

AUTOLAB = [sys.executable, "-m", "controller.cli.main"]


def test_the_gate_holds_the_first_batch_and_the_wait_is_not_start_up(bench, tmp_path):
    gate = tmp_path / "gate"
    gate.write_text("busy\n")
    removed = []
    opened = threading.Timer(16.0, lambda: (gate.unlink(), removed.append(time.time())))  # past the 10-s allowance
    opened.start()
    try:
        done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(TRAIN),
                               "--result", str(tmp_path / "r.json"), "--source", "synthetic", "--budget", "2",
                               "--startup-allowance", "10", "--sandbox", "auto", "--gate", str(gate),
                               "--handover", str(tmp_path / "handover")],
                              env=env_for(bench.cache), capture_output=True, text=True, timeout=300)
    finally:
        opened.cancel()
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["status"] == "succeeded", result["reason"] + done.stdout[-2000:]
    timing = result["timing"]
    assert timing["startup_seconds"] < 10 < timing["startup_seconds"] + timing["gpu_wait_seconds"]
    assert "waiting for the GPU" in done.stdout and "its first batch waits" in done.stdout
    assert timing["trained_from"] >= removed[0] - 0.01  # no batch before the gate opened
    # The GPU was handed over once the candidate was gone, before the verdict.
    assert (tmp_path / "handover").stat().st_mtime <= (tmp_path / "r.json").stat().st_mtime
    assert (tmp_path / "handover").stat().st_mtime >= timing["trained_until"]


def request(lab, source: str, run: str) -> RunRequest:
    return RunRequest(run=run, experiment=run, campaign="c", candidate_source=source, slot="0",
                      profile="tiny", data="synthetic", budget_seconds=2)


def test_a_run_started_ahead_is_taken_over_by_its_own_submit_and_stopped_by_any_other(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_UNSAFE_NO_SANDBOX", "1")
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2)
    backend = LocalBackend(lab.root)
    source = lab.repo.master_source()
    backend.start_next(request(lab, source, "exp-a-1"))
    ahead = json.loads((backend.next_dir("0") / "launch.json").read_text())
    assert ahead["ahead"] is True and (backend.next_dir("0") / "gate").exists()

    # Another request for the slot (the candidate was rebased): the one started ahead is stopped.
    other = source.replace("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4")
    obs = backend.submit(request(lab, other, "exp-a-1"))
    assert not backend.next_dir("0").exists()
    assert not Path(f"/proc/{ahead['pid']}").exists() or "Z" in Path(f"/proc/{ahead['pid']}/stat").read_text().split()[2]
    fresh = json.loads((backend.run_dir("exp-a-1") / "launch.json").read_text())
    assert fresh["pid"] != ahead["pid"] and fresh["ahead"] is False and obs.state in ("running", "succeeded")
    backend.cancel("exp-a-1")

    # The same run submitted on another slot (another GPU freed first): the one started ahead on
    # slot 0 is stopped, not left waiting.
    backend.start_next(request(lab, source, "exp-c-1"))
    ahead = json.loads((backend.next_dir("0") / "launch.json").read_text())
    elsewhere = RunRequest(**{**request(lab, source, "exp-c-1").__dict__, "slot": "1"})
    backend.submit(elsewhere)
    assert not backend.next_dir("0").exists()
    assert json.loads((backend.run_dir("exp-c-1") / "launch.json").read_text())["pid"] != ahead["pid"]
    backend.cancel("exp-c-1")

    # The same request: the run started ahead becomes the run, and trains once its gate opens.
    backend.start_next(request(lab, source, "exp-b-1"))
    ahead = json.loads((backend.next_dir("0") / "launch.json").read_text())
    backend.submit(request(lab, source, "exp-b-1"))
    taken = json.loads((backend.run_dir("exp-b-1") / "launch.json").read_text())
    assert taken["pid"] == ahead["pid"] and not (backend.run_dir("exp-b-1") / "gate").exists()
    deadline = time.time() + 240
    while backend.observe("exp-b-1").state == "running" and time.time() < deadline:
        time.sleep(0.2)
    obs = backend.observe("exp-b-1")
    assert obs.state == "succeeded", obs.message  # its result landed in the renamed directory
    assert obs.result["timing"]["gpu_wait_seconds"] is not None
    curve = Path(obs.result["curve"])  # named where it is now, not where the run started
    assert curve.parent == backend.run_dir("exp-b-1") and curve.is_file()


def test_through_the_loop_the_next_run_starts_up_during_the_evaluation_and_trains_after_the_verdict(tmp_path):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3)
    # Two candidates that cannot be promoted, so the second is measured on the master it was
    # checked on and its early start is kept: logits capped at +-0.5, and a head that never
    # learns (its weights start near 0). A plain learning rate of 0 for the block matrices was
    # not enough: in a 3-s budget on a busy machine it sometimes beat the baseline by noise.
    for name, old, new in (("slow-a", "LOGIT_SOFTCAP = 15.0 ", "LOGIT_SOFTCAP = 0.5 "),
                           ("slow-b", "UNEMBEDDING_LR = 0.02", "UNEMBEDDING_LR = 0.0")):
        lab.apply_file(spec_from_edit(lab, name, old, new, f"{new.strip()} changes nothing."), "test")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), AUTOLAB_GPUS="0",
               AUTOLAB_UNSAFE_NO_SANDBOX="1")
    done = subprocess.run(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2", "--unsafe-no-sandbox"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = lab.root / ".autolab" / "runs"
    first, second = (json.loads((runs / r / "result.json").read_text()) for r in ("exp-slow-a-1", "exp-slow-b-1"))
    launch = json.loads((runs / "exp-slow-b-1" / "launch.json").read_text())
    verdict_of_first = (runs / "exp-slow-a-1" / "result.json").stat().st_mtime
    assert first["status"] == second["status"] == "succeeded", (first["reason"], second["reason"])
    assert launch["ahead"] is True
    assert launch["startedAt"] < verdict_of_first  # it started up while the first was evaluated
    assert second["timing"]["trained_from"] >= verdict_of_first  # and trained after its verdict
    assert second["timing"]["trained_from"] >= first["timing"]["trained_until"]
    assert not list(runs.glob(".next-*"))  # nothing started ahead is left behind

