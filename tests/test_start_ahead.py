"""The next run starts up while the one before it on the GPU is evaluated, and trains only after its verdict.

Evaluation needs the GPU far less than training, and a run's start-up (imports, compiling,
warming up) needs it hardly at all; so once a run's candidate is gone and its evaluator holds
the memory it needs (`--handover`), the local backend may start the slot's next run beside it
(`LocalBackend.start_next`, asked by the engine). That run waits at its first batch, its clock
not started (`--gate`), until the submit of exactly the same request takes it over after the
verdict; anything else on the slot stops it. An evaluation that runs out of time beside that
run asks for the GPU back (`--handback`), and is measured again alone. Real harness, tiny CPU
profile; AUTOLAB_GPUS=0 stands in for one GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from controller.backends import RunRequest
from controller.backends.local import LocalBackend
from controller.local import init_lab
from labkit import spec_from_edit
from test_run_phases import BENCH, TRAIN, bench, env_for  # noqa: F401  (the module fixture)

AUTOLAB = [sys.executable, "-m", "controller.cli.main"]


def test_the_gate_holds_the_first_batch_and_the_wait_is_not_start_up(bench, tmp_path):
    gate = tmp_path / "gate"
    gate.write_text("busy\n")
    removed = []
    # Opened past the 10-s allowance, and past a start-up slowed by a busy machine (its imports are
    # the sandbox's check's, which the allowance does not count).
    opened = threading.Timer(25.0, lambda: (gate.unlink(), removed.append(time.time())))
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
    assert timing["gpu_wait_seconds"] > 0 and timing["startup_seconds"] + timing["gpu_wait_seconds"] > 10
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
    # minDelta 1 bpb: no repeat runs of the master first (they are not what this is about),
    # and no candidate can be promoted.
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta=1.0)
    # Two candidates that cannot be promoted, so the second is measured on the master it was
    # checked on and its early start is kept: logits capped at +-0.5, and a head that never
    # learns (its weights start near 0).
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



def test_a_gate_that_never_opens_is_an_error_not_the_candidates_crash(bench, tmp_path, monkeypatch):
    """Nobody opens the gate within the harness's bound (a controller that hangs): the run gives
    up as an error, nothing measured. The stream it waited on closes under the candidate, which
    then dies; that death is not its verdict. The bound, 30 minutes, is cut to 3 s here."""
    gate = tmp_path / "gate"
    gate.write_text("busy\n")
    monkeypatch.setattr(bench.harness.stream, "GATE_LIMIT_SECONDS", 3.0)
    result = bench.run.run_candidate(TRAIN, tmp_path / "r.json", source="synthetic", budget=2,
                                     sandbox_request="none", gate=gate, echo=False)
    assert (result["status"], result["reason_code"]) == ("error", "HarnessError"), result["reason"]
    assert "the GPU was not handed over within 3s" in result["reason"]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                text = Path(f"/proc/{entry}/stat").read_text()
                if int(text[text.rfind(")") + 2:].split()[1]) == pid:
                    out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rfind(")") + 2] not in "ZX"


GIVE_UP_BOUND = 15.0  # seconds from the controller's death to no process of its run started ahead


def _submitted_runs_alive(runs: Path) -> list[int]:
    """The process groups of the submitted runs still going (each harness leads its own session)."""
    groups = []
    for launch in runs.glob("[!.]*/launch.json"):
        if (launch.parent / "result.json").exists():
            continue
        with contextlib.suppress(OSError, ValueError, KeyError):
            pid = json.loads(launch.read_text())["pid"]
            if _alive(pid):
                groups.append(os.getpgid(pid))
    return groups


def test_a_run_waiting_at_its_gate_gives_up_when_autolab_run_is_killed_and_the_next_run_reaps_it(tmp_path):
    """kill -9 of `autolab run` (an OOM kill, a crash) skips every cleanup. The run it started up
    ahead of its turn would wait at its gate for a submit nobody will make, holding a GPU's memory.
    It watches its controller (a pipe only the controller holds): within GIVE_UP_BOUND neither its
    harness nor its candidate is alive, it ends as an error (nothing measured, never the
    candidate's crash), and the next `autolab run` says what it reaped and measures both."""
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta=1.0)
    for name, old, new in (("slow-a", "LOGIT_SOFTCAP = 15.0 ", "LOGIT_SOFTCAP = 0.5 "),
                           ("slow-b", "UNEMBEDDING_LR = 0.02", "UNEMBEDDING_LR = 0.0")):
        lab.apply_file(spec_from_edit(lab, name, old, new, f"{new.strip()} changes nothing."), "test")
    lab.close()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), AUTOLAB_GPUS="0",
               AUTOLAB_UNSAFE_NO_SANDBOX="1")
    runs = lab.root / ".autolab" / "runs"
    ahead_dir = runs / ".next-0"
    held: list[int] = []  # process groups stopped while the controller is killed
    with open(tmp_path / "first.log", "wb") as log:
        loop = subprocess.Popen(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2", "--unsafe-no-sandbox"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 300
        harness = candidate = None
        while time.time() < deadline and candidate is None:
            assert loop.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            launch = {}
            with contextlib.suppress(OSError, ValueError):
                launch = json.loads((ahead_dir / "launch.json").read_text())
            if launch.get("pid") and (ahead_dir / "gate").exists():
                harness = launch["pid"]
                kids = _children(harness)
                candidate = kids[0] if kids else None
            time.sleep(0.05)
        assert candidate is not None, "no run was started ahead"
        # The gate opens when the run being evaluated has its verdict. On a quiet machine a tiny
        # evaluation ends within seconds, so that run is held (SIGSTOP) while the one started ahead
        # imports and reaches its gate, and the controller is killed; it goes on afterwards.
        held[:] = _submitted_runs_alive(runs)
        for pgid in held:
            os.killpg(pgid, signal.SIGSTOP)
        time.sleep(4.0)  # the candidate imports and reaches its gate (its first batch waits there)
        assert (ahead_dir / "gate").exists() and _alive(candidate)
        loop.send_signal(signal.SIGKILL)
        loop.wait()
        killed_at = time.time()
        while (_alive(harness) or _alive(candidate)) and time.time() - killed_at < GIVE_UP_BOUND:
            time.sleep(0.1)
        gone_after = time.time() - killed_at
    finally:
        for pgid in held:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGCONT)
        if loop.poll() is None:
            loop.kill()
            loop.wait()
    assert not _alive(harness) and not _alive(candidate), f"still alive {GIVE_UP_BOUND:g}s after the controller died"
    given_up = json.loads((ahead_dir / "result.json").read_text())
    assert (given_up["status"], given_up["reason_code"]) == ("error", "HarnessError"), given_up
    assert "controller that started this run ahead of its turn is gone" in given_up["reason"]
    # The run that was being evaluated is a submitted run: it goes on and the next loop adopts it.
    deadline = time.time() + 120
    while not (runs / "exp-slow-a-1" / "result.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    again = subprocess.run(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2", "--unsafe-no-sandbox"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "reaped 1 run(s) started ahead by a controller that is gone: exp-slow-b-1 on slot 0" in again.stderr
    assert "it had given up by itself" in again.stderr
    results = {r: json.loads((runs / r / "result.json").read_text()) for r in ("exp-slow-a-1", "exp-slow-b-1")}
    assert all(r["status"] == "succeeded" for r in results.values()), results
    assert not list(runs.glob(".next-*"))
    print(f"the run started ahead was gone {gone_after:.1f}s after its controller was killed")


# --- an evaluation that runs out of time beside the next run's start-up -------------------------
# Alone, an evaluation past eval_timeout is the candidate's failure. Beside a run started up next
# to it the neighbour may be the cause, so the harness asks for the GPU back (`--handback`): the
# controller stops the neighbour, and the model is measured again alone. Without that, a candidate
# whose model is merely slow to score would be recorded as "nothing measured" and could be run again
# and again. The tiny profile's 120-s evaluation limit is cut to EVAL_LIMIT in a copy of the harness.
EVAL_LIMIT = 15.0
# The head's logits pushed through many square matrix products, only where there are no targets
# (the exported model): it trains and exports like the master, but scoring it takes minutes.
SLOW_OLD = "        if targets is None:\n            return logits\n"
SLOW_NEW = ("        if targets is None:\n"
            "            square = torch.eye(logits.size(-1), dtype=logits.dtype, device=logits.device)\n"
            "            for _ in range(60):\n"
            "                logits = torch.tanh(logits @ square) * LOGIT_SOFTCAP\n"
            "            return logits\n")


def quick_eval_bench(tmp_path: Path) -> Path:
    bench = tmp_path / "bench-src"
    shutil.copytree(BENCH, bench, ignore=shutil.ignore_patterns("perf", "__pycache__"))
    text = (bench / "prepare.py").read_text()
    assert text.count("eval_timeout=120.0") == 1  # the tiny profile's
    (bench / "prepare.py").write_text(text.replace("eval_timeout=120.0", f"eval_timeout={EVAL_LIMIT}"))
    return bench


def evaluators_of(bench: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(bench / "evaluate.py").encode() in argv:
            pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("answered", [True, False], ids=["controller-answers", "nobody-answers"])
def test_an_evaluation_slowed_beside_the_next_run_is_measured_again_alone(bench, tmp_path, answered):
    """Answered, the model is measured again alone and counts. Unanswered (a controller that does
    not know the hand-back, or has died), the harness waits a bounded time and records that
    nothing was measured, as it did before there was a hand-back: never a wait without end."""
    harness = quick_eval_bench(tmp_path)
    evaluator = (harness / "harness_evaluator.py").read_text()
    assert evaluator.count("HANDBACK_WAIT_SECONDS = 60.0") == 1
    (harness / "harness_evaluator.py").write_text(evaluator.replace("HANDBACK_WAIT_SECONDS = 60.0",
                                                                    "HANDBACK_WAIT_SECONDS = 3.0"))
    handover, handback = tmp_path / "handover", tmp_path / "handback"
    seen = {}

    def neighbour_then_controller():
        # The "next run" starts up once the GPU is handed over and takes it all: the evaluator
        # gets nothing done (stopped). When the harness asks for the GPU back, the controller
        # stops the neighbour (here: nothing left to stop) and removes the request.
        deadline = time.time() + 240
        while not handover.exists() and time.time() < deadline:
            time.sleep(0.02)
        starved = evaluators_of(harness)
        for pid in starved:
            os.kill(pid, signal.SIGSTOP)
        seen["starved"] = starved
        while not handback.exists() and time.time() < deadline:
            time.sleep(0.02)
        seen["handover_withdrawn"] = not handover.exists()
        if answered:
            handback.unlink()

    controller = threading.Thread(target=neighbour_then_controller, daemon=True)
    controller.start()
    done = subprocess.run([sys.executable, "-I", str(harness / "run.py"), "--candidate", str(harness / "train.py"),
                           "--result", str(tmp_path / "r.json"), "--source", "synthetic", "--budget", "2",
                           "--sandbox", "auto", "--handover", str(handover), "--handback", str(handback)],
                          env=env_for(bench.cache), capture_output=True, text=True, timeout=300)
    controller.join(timeout=5)
    result = json.loads((tmp_path / "r.json").read_text())
    assert seen["starved"], done.stdout[-2000:]
    assert seen["handover_withdrawn"]  # nothing more is started beside it
    if answered:
        assert result["status"] == "succeeded", result["reason"] + done.stdout[-2000:]
        assert "measuring the exported model once more" in done.stdout
        assert result["timing"]["evaluate_seconds"] > EVAL_LIMIT  # the first try ran out of time
    else:
        assert (result["status"], result["reason_code"]) == ("error", "EvaluationFailed"), result["reason"]
        assert "nothing was measured" in result["reason"] and "nobody gave the GPU back" in done.stdout


def test_through_the_loop_a_model_too_slow_to_score_alone_is_the_candidates_failure(tmp_path, monkeypatch):
    from controller.lab import init
    from controller.lab.ledger import Ledger

    harness = quick_eval_bench(tmp_path)
    monkeypatch.setattr(init, "bench_source_dir", lambda: harness)
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=3, min_delta=1.0)
    lab.apply_file(spec_from_edit(lab, "slow-eval", SLOW_OLD, SLOW_NEW, "A deeper head helps.", priority=1), "test")
    lab.apply_file(spec_from_edit(lab, "plain", "UNEMBEDDING_LR = 0.02", "UNEMBEDDING_LR = 0.0",
                                  "A frozen head changes nothing."), "test")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), AUTOLAB_GPUS="0",
               AUTOLAB_UNSAFE_NO_SANDBOX="1")
    runs = lab.root / ".autolab" / "runs"
    started_ahead, finished = [], threading.Event()

    def watch():  # which run was started up ahead, while the slow model was evaluated
        while not finished.wait(0.05):
            with contextlib.suppress(OSError, ValueError):
                launch = json.loads((runs / ".next-0" / "launch.json").read_text())
                if launch["run"] not in started_ahead:
                    started_ahead.append(launch["run"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        done = subprocess.run(AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2", "--unsafe-no-sandbox"],
                              env=env, capture_output=True, text=True, timeout=600)
    finally:
        finished.set()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert started_ahead == ["exp-plain-1"]  # beside the slow evaluation
    slow, plain = (json.loads((runs / r / "result.json").read_text()) for r in ("exp-slow-eval-1", "exp-plain-1"))
    # Started up beside the slow evaluation, the next run was stopped when the GPU was asked
    # back; the slow model, measured again alone, is the candidate's failure, recorded as such.
    log = (runs / "exp-slow-eval-1" / "log.txt").read_text()
    assert "asking for the GPU back" in log and "once more" in log, log[-3000:]
    assert (slow["status"], slow["reason_code"]) == ("failed", "EvaluationFailed"), slow["reason"]
    assert "then again with the GPU to itself" in slow["reason"]
    row = next(r for r in Ledger(lab.root / "research" / "results.tsv").rows() if r["run_id"] == "exp-slow-eval-1")
    assert row["status"] == "failed", row
    # The next experiment was submitted after the verdict, started afresh, and measured.
    launch = json.loads((runs / "exp-plain-1" / "launch.json").read_text())
    assert plain["status"] == "succeeded", plain["reason"]
    assert launch["ahead"] is False and launch["startedAt"] >= (runs / "exp-slow-eval-1" / "result.json").stat().st_mtime - 1
    assert not list(runs.glob(".next-*")) and not (runs / "exp-slow-eval-1" / "handback").exists()
