"""The local backend: the bench run harness as a child process on this machine.

Each run gets a directory `.autolab/runs/<run>/` holding `launch.json` (the
pid and its kernel start time, so a recycled pid is never mistaken for our
run), `candidate/train.py` (the committed bytes of the experiment, written by
the controller), `key` (the run's result-signing key), `log.txt` (the
harness's output) and, at the end, `result.json`, which the harness writes
atomically and signs. Runs start in their own session, so a killed
controller leaves them training; a restarted one finds the directory, sees the
process alive (or the result written) and adopts it instead of starting it
again. A run that vanished without a result is reported lost.

What the controller trusts (the candidate is hostile, see bench/sandbox.py):
the harness it starts is a pinned copy, `.autolab/harness/<commit>/`, written
from the git blobs of the lab's first commit and checked against them before
every run, never the lab's editable `bench/`; it runs with `python -I`; a
result is read only after the harness process has ended, and only if its
HMAC verifies under the run's key, it names this run and the sha1 of the bytes
the controller asked to run. After a run the lab's `bench/` is compared with
git; a change is restored and the run becomes an infrastructure error. Without
bubblewrap the harness refuses to run candidates, unless the user said
`autolab run --unsafe-no-sandbox` (AUTOLAB_UNSAFE_NO_SANDBOX=1), which every
result then says.

Compile caches: each run gets `--compile-cache-from <sha1 of the lab's starting
train.py>`, so that it starts with a copy of the compile cache the first run of
that program kept (bench/harness_compile_cache.py says why only that program's
is kept). On a machine where that program never ran (a lab resumed on a new GPU
host, its master measured elsewhere) there is no such cache, so each run also gets the
program's bytes, `starting.py` in its directory (the first commit's blob, read
from git like the pinned harness), with `--starting-program`: a harness that
finds no kept cache runs them first, in its sandbox, up to their first batch,
and keeps what they compiled; that warm-up is part of the run's harness
process, never a run of its own, so nothing here tracks it. A lab whose pinned
harness predates the option gets neither file nor option (its run.py is
searched for the option's name, as for the other options below) and compiles
from cold as it did.

A run started up ahead of its turn (`start_next`, `.autolab/runs/.next-<slot>/`)
waits at its gate for a submit that only a living controller makes, so unlike
a submitted run it must not outlive its controller. It gets the read end of a
pipe whose write end only this backend holds (`--gate-owner-fd`): when the
controller is gone, however it went (kill -9, an OOM kill, a crash, a library
user that never called `close()`), the pipe reads end of file and the harness
gives up while its gate is still closed. `launch.json` names the controller
(`owner`: pid and start time); the next controller reaps what is left
(`reap_stale`) and says what it reaped.

Slots are GPUs: one run per visible GPU with `CUDA_VISIBLE_DEVICES` set to
its id, or one CPU slot on a machine without GPUs. `AUTOLAB_GPUS=0,1` names
the ids by hand (tests use it to stand in for GPUs).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

from controller.lab.harness import (HarnessError, git_bytes, pinned_files,  # noqa: F401
                                    pinned_harness, starting_program)
from controller.backends import Backend, RunRequest
from controller.backends.results import authentic, result_signature
from controller.core.reconcile import RunObservation
from controller.lab.files import atomic_write
from controller.lab.paths import LabPaths


def visible_slots(configured: int = 0) -> list[str]:
    """Slot ids for this machine: GPU ids, or ["cpu"]."""
    ids: list[str] = []
    env = os.environ.get("AUTOLAB_GPUS")
    if env is not None:
        ids = [x.strip() for x in env.split(",") if x.strip()]
    elif os.environ.get("CUDA_VISIBLE_DEVICES") not in (None, ""):
        ids = [x.strip() for x in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if x.strip()]
    elif shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout
            ids = [x.strip() for x in out.splitlines() if x.strip()]
        except (OSError, subprocess.SubprocessError):
            ids = []
    if not ids:
        ids = ["cpu"]
    if ids == ["cpu"] and configured > 1:
        ids = [f"cpu{i}" for i in range(configured)]
    elif configured > 0:
        ids = ids[:configured]
    return ids


def _start_ticks(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    state = fields[0]
    if state in ("Z", "X"):
        return None
    return fields[19]


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _stop(launch: dict) -> None:
    """SIGTERM, then SIGKILL, to the process group of a launched run, until it is gone."""
    pid = launch["pid"]
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.time() + wait
        while time.time() < deadline and _start_ticks(pid) == launch["start"]:
            _reap(pid)
            time.sleep(0.05)
        if _start_ticks(pid) != launch["start"]:
            break
    _reap(pid)


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


UNSAFE_ENV = "AUTOLAB_UNSAFE_NO_SANDBOX"


class LocalBackend(Backend):
    name = "local"
    starts_ahead = True  # a slot's next run starts up while its run is evaluated

    def __init__(self, lab_root: str | Path, bench_dir: str | Path | None = None,
                 cache_dir: str | None = None):
        self.root = Path(lab_root).resolve()
        self.runs = LabPaths.of(self.root).state / "runs"
        self.bench = Path(bench_dir) if bench_dir else self.root / "bench"
        self.cache_dir = cache_dir
        self._start: tuple[str | None, bytes | None] | None = None  # the starting program (sha1, bytes)
        self._owner: weakref.finalize | None = None  # closes the pipe runs started ahead watch

    def close(self) -> None:
        """Stop the runs started ahead by this backend and drop the pipe they watch. Submitted runs
        go on (the next controller adopts them)."""
        self.stop_next()
        if self._owner is not None:
            self._owner()  # closes both ends
            self._owner = None

    def reap_stale(self) -> list[str]:
        """Stop and remove the runs started ahead by a controller that is gone (one per line, for a
        person: which run, which slot, what was done). Each gives up by itself once its controller is
        gone; this also clears the directories they leave, and any run a harness without
        --gate-owner-fd started."""
        me = {"pid": os.getpid(), "start": _start_ticks(os.getpid())}
        reaped = []
        for d in sorted(self.runs.glob(".next-*")) if self.runs.is_dir() else []:
            launch = _read_json(d / "launch.json")
            owner = launch.get("owner") if isinstance(launch.get("owner"), dict) else {}
            if owner == me or (owner.get("pid") and _start_ticks(owner["pid"]) == owner.get("start")):
                continue  # its controller lives (this one, or another loop on the lab)
            alive = bool(launch.get("start")) and _start_ticks(launch["pid"]) == launch["start"]
            if alive:
                _stop(launch)
            shutil.rmtree(d, ignore_errors=True)
            slot = d.name[len(".next-"):]
            reaped.append(f"{launch.get('run') or d.name} on slot {slot} (pid {launch.get('pid')}): "
                          + ("stopped" if alive else "it had given up by itself"))
        return reaped

    def _owner_fd(self) -> int:
        """The read end of the pipe runs started ahead watch (see the module docstring)."""
        if self._owner is None or not self._owner.alive:
            r, w = os.pipe()  # neither end inherited unless passed: submitted runs never hold it
            # A backend dropped without close() closes it when collected: its runs give up then.
            self._owner = weakref.finalize(self, _close_fds, r, w)
        return self._owner.peek()[2][0]

    def run_dir(self, run: str) -> Path:
        return self.runs / run

    def log_path(self, run: str) -> Path:
        return self.run_dir(run) / "log.txt"

    # -- the pinned harness --------------------------------------------------------------------
    def harness(self) -> Path:
        """The pinned harness directory (see pinned_harness)."""
        return pinned_harness(self.root)

    def sandbox_problem(self) -> str | None:
        """None if this machine can sandbox candidates (the pinned harness asks bubblewrap) and the
        sandbox's uid can find and read what the benchmark imports (`sandbox.py --quick`: no torch
        import; each run's boot imports it before its candidate); else what is wrong, ending in
        the fix."""
        try:
            harness = self.harness()
        except HarnessError as e:
            return str(e)
        done = subprocess.run([sys.executable, "-I", str(harness / "sandbox.py"), "--quick"],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return None
        why = done.stdout.strip() or done.stderr.strip()
        if done.returncode == 2:  # a sandbox, unfit to run the benchmark: no runs until it is fixed
            return f"candidates cannot run in the sandbox here: {why}"
        return (f"cannot isolate candidates on this machine: {why}. Install bubblewrap, or pass "
                "--unsafe-no-sandbox for candidates you trust")

    def restore_bench(self) -> list[str]:
        """Put the lab's harness files (every file its manifest lists, bench/HARNESS itself) back
        as git has them; the ones that had changed. (Runs never use them: a change means
        something escaped a sandbox, or ran without one.)"""
        try:
            paths = [f"bench/{n}" for n in pinned_files(self.root)]
        except HarnessError:
            return []  # no first commit: no harness to restore
        st = git_bytes(self.root, "status", "--porcelain", "--", *paths)
        changed = [line[3:] for line in st.stdout.decode(errors="replace").splitlines() if line.strip()]
        if changed:
            git_bytes(self.root, "checkout", "HEAD", "--", *changed)
        return changed

    # -- runs ----------------------------------------------------------------------------------
    def submit(self, req: RunRequest) -> RunObservation:
        d = self.run_dir(req.run)
        if (d / "launch.json").exists() or (d / "result.json").exists():
            return self.observe(req.run)  # adopt: never start a run twice
        if self._take_started(req):
            return self.observe(req.run)
        d.mkdir(parents=True, exist_ok=True)
        try:
            harness = self.harness()
        except HarnessError as e:
            return RunObservation(req.run, "error", message=str(e),
                                  result={"status": "error", "reason_code": "HarnessError",
                                          "reason": str(e)})
        self._launch(d, req, harness)
        return self.observe(req.run)

    # -- the next run starts up while this one is evaluated ------------------------------------
    def next_dir(self, slot: str | None) -> Path:
        """Where the run started up ahead on `slot` waits to be submitted (see `start_next`)."""
        return self.runs / f".next-{slot}"

    def start_next(self, req: RunRequest) -> None:
        """Start the run `req` describes on its slot now, held at its first batch.

        The engine asks for this while the slot's run is evaluated (`RunObservation.handover`):
        the candidate imports, compiles and warms up beside that evaluation, and waits at its
        first batch, its clock not started, until `submit` of the same request takes it over and
        opens the gate. A `submit` of anything else on the slot (the master moved and the
        candidate was rebased, another experiment came first) stops it: nothing of it is kept.
        """
        d = self.next_dir(req.slot)
        if self._fingerprint(req) == _read_json(d / "launch.json").get("fingerprint"):
            return  # already starting up
        if self.run_dir(req.run).exists():
            return  # submitted before (a controller that stopped in between): submit adopts it
        self.stop_next(req.slot)
        try:
            harness = self.harness()
        except HarnessError:
            return  # the real submit says why
        d.mkdir(parents=True)
        (d / "gate").write_text("the run before this one on the GPU is still being evaluated\n")
        self._launch(d, req, harness, ahead=True)

    def stop_next(self, slot: str | None = None) -> None:
        """Stop the run started up ahead on `slot` (every slot: None), if any, and remove it."""
        for d in ([self.next_dir(slot)] if slot is not None else list(self.runs.glob(".next-*"))):
            launch = _read_json(d / "launch.json")
            if launch.get("pid") and launch.get("start"):
                _stop(launch)
            shutil.rmtree(d, ignore_errors=True)

    def give_back(self, run: str) -> None:
        """The GPU back to `run`, whose evaluation ran out of time beside the run started up ahead
        on its slot (`RunObservation.handback`): that run is stopped, then the harness's request
        file removed, which tells it the GPU is its alone and it measures the model again. The
        stopped run loses only its start-up; its experiment is submitted as usual after the
        verdict, and starts up then."""
        d = self.run_dir(run)
        slot = _read_json(d / "launch.json").get("slot")
        if slot is not None:
            self.stop_next(str(slot))
        (d / "handback").unlink(missing_ok=True)

    def _take_started(self, req: RunRequest) -> bool:
        """Take over the run started up ahead for exactly this request, if any: it becomes the
        run (its directory renamed, its gate opened). Another one on the slot is stopped."""
        for d in self.runs.glob(".next-*") if self.runs.is_dir() else []:
            launch = _read_json(d / "launch.json")
            mine = launch.get("fingerprint") == self._fingerprint(req)
            if mine and launch.get("start") and _start_ticks(launch["pid"]) == launch["start"]:
                try:
                    os.rename(d, self.run_dir(req.run))  # the harness works relative to its directory
                except OSError:
                    self.stop_next(d.name[len(".next-"):])
                    return False
                (self.run_dir(req.run) / "gate").unlink()
                return True
            if mine or launch.get("run") == req.run or d == self.next_dir(req.slot):
                self.stop_next(d.name[len(".next-"):])  # stale, or for this run on another slot
        return False

    def _fingerprint(self, req: RunRequest) -> str:
        what = [req.run, req.experiment, hashlib.sha1(req.candidate_source.encode()).hexdigest(), req.slot,
                req.profile, req.data, req.budget_seconds, req.seed, os.environ.get(UNSAFE_ENV) == "1",
                req.eval_limit]
        return hashlib.sha1(json.dumps(what).encode()).hexdigest()

    def _launch(self, d: Path, req: RunRequest, harness: Path, ahead: bool = False) -> None:
        code = req.candidate_source.encode("utf-8")
        (d / "candidate").mkdir(exist_ok=True)
        (d / "candidate" / "train.py").write_bytes(code)  # the committed bytes, not a worktree
        key = os.urandom(32)
        fd = os.open(d / "key", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        unsafe = os.environ.get(UNSAFE_ENV) == "1"
        key_r, key_w = os.pipe()
        # Paths relative to the run's directory, the harness's working directory: a run started
        # up ahead keeps writing into it after `submit` has renamed it.
        cmd = [sys.executable, "-I", str(harness / "run.py"),
               "--candidate", "candidate/train.py", "--result", "result.json",
               "--source", req.data, "--termination-log", "termination.json",
               "--sandbox", "none" if unsafe else "bwrap", "--key-fd", str(key_r), "--run", req.run]
        if req.budget_seconds:
            cmd += ["--budget", str(req.budget_seconds)]
        if req.seed:
            cmd += ["--seed", str(req.seed)]
        knows = (harness / "run.py").read_bytes()  # a lab's pinned harness may predate these
        start, program = self._starting_program(harness)
        if start:  # the one compile cache runs may start from: the lab's own starting program's
            cmd += ["--compile-cache-from", start]
            if program is not None and b"--starting-program" in knows:  # built here if none is kept
                (d / "starting.py").write_bytes(program)
                cmd += ["--starting-program", "starting.py"]
        fds = [key_r]
        if b"--handover" in knows:
            cmd += ["--handover", "handover"] + (["--gate", "gate"] if ahead else [])
        if ahead and b"--gate-owner-fd" in knows:
            fds.append(self._owner_fd())
            cmd += ["--gate-owner-fd", str(fds[-1])]
        if b"--handback" in knows:
            cmd += ["--handback", "handback"]
        if req.eval_limit and b"--eval-limit" in knows:
            cmd += ["--eval-limit", f"{req.eval_limit:g}"]
        env = {k: v for k, v in os.environ.items()
               if k in ("PATH", "LANG", "LC_ALL", "HOME", "LD_LIBRARY_PATH", "AUTOLAB_CACHE",
                        "HF_ENDPOINT", "HF_HUB_OFFLINE", "HF_TOKEN", "OMP_NUM_THREADS",
                        "AUTOLAB_EARLY_EVALUATOR")}
        env.update(AUTOLAB_BENCH_PROFILE=req.profile, PYTHONUNBUFFERED="1")
        cpu = req.slot is None or str(req.slot).startswith("cpu")
        env["CUDA_VISIBLE_DEVICES"] = "" if cpu else str(req.slot)
        if self.cache_dir:
            env["AUTOLAB_CACHE"] = self.cache_dir
        with open(d / "log.txt", "ab") as log:
            proc = subprocess.Popen(cmd, cwd=str(d), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    pass_fds=tuple(fds))
        os.close(key_r)
        with os.fdopen(key_w, "wb") as f:
            f.write(key)
        atomic_write(d / "launch.json", json.dumps({
            "pid": proc.pid, "start": _start_ticks(proc.pid), "slot": req.slot,
            "experiment": req.experiment, "startedAt": time.time(), "cmd": cmd,
            "candidateSha1": hashlib.sha1(code).hexdigest(), "sandbox": not unsafe,
            "fingerprint": self._fingerprint(req), "ahead": ahead, "run": req.run,
            "owner": {"pid": os.getpid(), "start": _start_ticks(os.getpid())} if ahead else None}) + "\n")

    def _starting_program(self, harness: Path) -> tuple[str | None, bytes | None]:
        """The sha1 and the bytes of the lab's starting train.py, if the pinned harness keeps
        compile caches (a lab made before it did runs every candidate from a cold cache)."""
        if self._start is None:
            program = None
            if b"--compile-cache-from" in (harness / "run.py").read_bytes():
                program = starting_program(self.root)
            self._start = (hashlib.sha1(program).hexdigest() if program is not None else None, program)
        return self._start

    def _judge(self, run: str, launch: dict) -> dict:
        """The result of a run that has ended, as far as the controller believes it."""
        d = self.run_dir(run)
        try:
            result = json.loads((d / "result.json").read_text())
            if not isinstance(result, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return {"status": "failed", "reason_code": "ResultNotAuthentic",
                    "reason": f"the result file is unreadable ({e})"}
        wrong = self._authentic(run, launch, result)
        if wrong:
            return {"status": "failed", "reason_code": "ResultNotAuthentic",
                    "reason": f"the result in {d / 'result.json'} is not this run's harness's: "
                              f"{wrong}; nothing of it is believed"}
        changed = self.restore_bench()
        if changed:
            return {"status": "error", "reason_code": "HarnessTampered",
                    "reason": f"the lab's {', '.join(changed)} changed during the run and was "
                              "restored from git; the run is void"}
        return result

    def _authentic(self, run: str, launch: dict, result: dict) -> str | None:
        """None if the result is this run's harness's (the result contract); else what is
        wrong with it."""
        try:
            key = (self.run_dir(run) / "key").read_bytes()
        except OSError:
            return "the run's key is missing"
        return authentic(result, key, run, launch.get("candidateSha1"))

    def observe(self, run: str) -> RunObservation:
        d = self.run_dir(run)
        launch = {}
        if (d / "launch.json").exists():
            launch = json.loads((d / "launch.json").read_text())
        worker = f"local:{os.uname().nodename}:{launch.get('slot')}"
        if launch.get("sandbox") is False:  # every status and the ledger row say so
            worker += ":UNSANDBOXED"
        job_id = str(launch.get("pid", ""))
        if launch.get("start") and _start_ticks(launch["pid"]) == launch["start"]:
            return RunObservation(run, "running", job_id=job_id, worker=worker,  # no peeking
                                  handover=(d / "handover").exists(), handback=(d / "handback").exists())
        if not (d / "result.json").exists():
            if not launch:
                return RunObservation(run, "missing")
            return RunObservation(run, "lost", message="the run process exited without writing "
                                                       f"a result; see {d / 'log.txt'}",
                                  job_id=job_id, worker=worker)
        self._reap(launch)
        verdict = d / "verdict.json"  # the controller's view of the result, decided once
        if verdict.exists():
            result = json.loads(verdict.read_text())
        else:
            result = self._judge(run, launch)
            atomic_write(verdict, json.dumps(result) + "\n")
        state = {"succeeded": "succeeded", "failed": "failed", "error": "error",
                 "cancelled": "cancelled"}.get(result.get("status"), "failed")
        return RunObservation(run, state, result=result, message=result.get("reason", ""),
                              job_id=job_id, worker=worker)

    def _reap(self, launch: dict) -> None:
        if launch.get("pid"):
            _reap(launch["pid"])

    def cleanup(self, run: str) -> None:
        """Nothing to remove: the run's directory (log, result) stays as its record."""

    def leftovers(self, run: str) -> bool:
        return False

    def cancel(self, run: str) -> RunObservation:
        d = self.run_dir(run)
        obs = self.observe(run)
        if obs.state != "running":
            return obs
        _stop(json.loads((d / "launch.json").read_text()))
        if not (d / "result.json").exists():
            result = {"version": 2, "run": run, "status": "cancelled",
                      "reason": "cancelled by the user", "exit_code": None}
            key = (d / "key").read_bytes() if (d / "key").exists() else b""
            result["signature"] = result_signature(key, result)
            atomic_write(d / "result.json", json.dumps(result) + "\n")
        return self.observe(run)

    def slot_of(self, run: str) -> str | None:
        p = self.run_dir(run) / "launch.json"
        return json.loads(p.read_text()).get("slot") if p.exists() else None
