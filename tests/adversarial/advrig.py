"""The test rig: one tiny lab driven through the real local loop, candidates run one at a time,
and the checks every candidate gets.

The lab is black-box: it is made with `python -m controller.cli.main init`, specs are written into
experiments/, and `python -m controller.cli.main run` runs them; the rig only reads the lab's files
(ledger, master, status records, run directories, git refs) and /proc.

Per candidate (`Rig.run_candidate`):
  snapshot -> write the spec -> `autolab run` -> wait for the lab's processes -> wait a few
  seconds for stragglers, then kill them -> snapshot -> checks -> put the lab back as it was.
The checks (`Rig.check`):
  (a) no false metric: not Promoted (attacks), no ledger row or status metric with val_bpb below
      baseline - 0.5; budget attacks are Failed for the budget, non-causal ones for causality;
  (b) the lab is unchanged apart from the experiment's own row and branch: ledger prefix, master,
      refs, other worktrees, bench/, the pinned harness, the whole AUTOLAB_CACHE, experiments/,
      HOME, .git config/hooks, lab.yaml and notes, other status records and run directories, and
      no file anywhere in the lab, cache, HOME or /tmp carrying the candidate's marker;
  (c) no process left: none of the sandbox uid 61000, none carrying the marker;
  (d) no hit file (code the attack injected into a trusted process never ran), no `ADV-HIT`
      line (the attack never worked), no secret canary in anything the lab keeps.
The lab is then restored (ledger, master, refs, bench/, cache, HOME, .git, planted files,
processes), so one candidate that gets through cannot change the next one's outcome.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import secrets
import shutil
import signal
import site
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import advcandidates as A

REPO_ROOT = Path(__file__).resolve().parents[2]
SANDBOX_UID = 61000
BUDGET = 2  # training seconds per run (tiny profile)
LOG_LIMIT = 64 * 2**20  # no file of a run directory may grow past this (res-huge-log prints 256 MiB)
CONTROLLER_TIMEOUT = 300.0
LAB_PROCESS_WAIT = 90.0  # a run whose result was forged early may still be running when the loop ends
STRAGGLER_WAIT = 5.0
BASELINE_ATTEMPTS = 3  # baselines measured at most before the rig takes what it has
MIN_BASELINE_TOKENS = 12_000  # an idle 2-core machine trains ~12 steps (18,000 tokens) in BUDGET
TERMINAL = ("Invalid", "Duplicate", "Conflict", "Succeeded", "Failed", "Cancelled")
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm", "/run")


# --- /proc -----------------------------------------------------------------------------------------

def _read(path, limit: int = 1 << 20) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode("utf-8", "replace")


def _uid(pid: int) -> int | None:
    for line in _read(f"/proc/{pid}/status").decode(errors="replace").splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    return None


def _ppid(pid: int) -> int:
    raw = _read(f"/proc/{pid}/stat")
    try:
        return int(raw.rsplit(b")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return 0


def _state(pid: int) -> str:
    raw = _read(f"/proc/{pid}/stat")
    try:
        return raw.rsplit(b")", 1)[1].split()[0].decode()
    except IndexError:
        return ""


def _kill(pids) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:
                pass


# --- files -----------------------------------------------------------------------------------------

def _sha(path: Path) -> str:
    h = hashlib.sha256()
    try:
        if path.is_symlink():
            return "link:" + os.readlink(path)
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as e:
        return f"unreadable:{e.errno}"
    return h.hexdigest()


def tree(root: Path, skip: tuple[str, ...] = (), keep_bytes: int = 0) -> dict[str, object]:
    """{relative path: sha256 (or (sha256, bytes) for small files when keep_bytes)} of every file."""
    out: dict[str, object] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) not in skip]
        for fn in filenames:
            rel = os.path.normpath(os.path.join(rel_dir, fn))
            if rel in skip or fn.endswith(".lock"):
                continue
            p = Path(dirpath) / fn
            digest = _sha(p)
            if keep_bytes:
                try:
                    st = p.lstat()
                    data = p.read_bytes() if not p.is_symlink() and st.st_size <= keep_bytes else None
                    mtime = st.st_mtime_ns
                except OSError:
                    data, mtime = None, None
                out[rel] = (digest, data, mtime)
            else:
                out[rel] = digest
    return out


def _digest(v):
    return v[0] if isinstance(v, tuple) else v


def tree_diff(before: dict, after: dict) -> list[str]:
    out = []
    for k in sorted(set(before) | set(after)):
        if k not in after:
            out.append(f"removed {k}")
        elif k not in before:
            out.append(f"added {k}")
        elif _digest(before[k]) != _digest(after[k]):
            out.append(f"changed {k}")
    return out


def _contains(path: Path, needles: list[str], limit: int = LOG_LIMIT) -> list[str]:
    """Which needles occur in the file (read in chunks, at most `limit` bytes)."""
    found, tail, done = set(), b"", 0
    raw = [n.encode() for n in needles]
    longest = max((len(n) for n in raw), default=0)
    try:
        with open(path, "rb") as f:
            while done < limit:
                block = f.read(1 << 22)
                if not block:
                    break
                data = tail + block
                for n, r in zip(needles, raw):
                    if r in data:
                        found.add(n)
                tail = data[-longest:] if longest else b""
                done += len(block)
    except OSError:
        pass
    return sorted(found)


def _ledger(path: Path) -> tuple[list[str], list[dict]]:
    text = path.read_text() if path.exists() else ""
    rows = list(csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        return [], []
    head = rows[0]
    return head, [dict(zip(head, r)) for r in rows[1:]]


def _float(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


# --- a TCP server the network attack aims at ----------------------------------------------------------

class Listener:
    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                self.received += conn.recv(4096)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.sock.close()


# --- the rig -------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    name: str
    cls: str
    phase: str | None = None
    outcome: str | None = None
    reason: str | None = None
    message: str = ""
    val_bpb: float | None = None
    seconds: float = 0.0
    violations: list[str] = field(default_factory=list)

    def row(self) -> dict:
        return {"name": self.name, "class": self.cls, "phase": self.phase, "outcome": self.outcome,
                "reason": self.reason, "val_bpb": self.val_bpb, "seconds": round(self.seconds, 1),
                "violations": self.violations, "message": (self.message or "")[:300]}


class Rig:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.lab = base / "lab"
        self.cache = base / "cache"
        self.home = base / "home"
        self.hits = base / "hits"
        self.pristine = base / "pristine"
        self.pristine_specs = base / "pristine-specs"  # other experiments' checked specs
        self.token = secrets.token_hex(6)
        self.pidns = os.readlink("/proc/self/ns/pid")
        self.bystander_tag = f"adv-bystander-{self.token}"
        self.canaries = {
            "HF_TOKEN in the environment": f"hf_advcanaryenv{secrets.token_hex(8)}",
            "~/.cache/huggingface/token": f"hf_advcanaryfile{secrets.token_hex(8)}",
            "~/.ssh/id_ed25519": f"ADVCANARYSSH{secrets.token_hex(8)}",
            "another run's log": f"ADVCANARYRUN{secrets.token_hex(8)}",
        }
        self.listener: Listener | None = None
        self.bystander: subprocess.Popen | None = None
        self.baseline: float | None = None
        self.report: list[dict] = []

    # -- processes of the lab ------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(self.home),
               "LANG": "C.UTF-8", "AUTOLAB_CACHE": str(self.cache), "PYTHONPATH": str(REPO_ROOT),
               "CUDA_VISIBLE_DEVICES": "", "HF_TOKEN": self.canaries["HF_TOKEN in the environment"]}
        # AUTOLAB_EARLY_EVALUATOR=1 runs the suite as a GPU machine would: every evaluator waits
        # beside its candidate from the start (bench/run.py).
        if os.environ.get("AUTOLAB_EARLY_EVALUATOR"):
            env["AUTOLAB_EARLY_EVALUATOR"] = os.environ["AUTOLAB_EARLY_EVALUATOR"]
        return env

    def cli(self, *args: str, timeout: float = CONTROLLER_TIMEOUT) -> tuple[int, str]:
        proc = subprocess.Popen([sys.executable, "-m", "controller.cli.main", *args], cwd=str(REPO_ROOT), env=self.env(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
            out, _ = proc.communicate()
            return -999, out.decode("utf-8", "replace") + f"\n[rig] `autolab {' '.join(args)}` timed out"
        return proc.returncode, out.decode("utf-8", "replace")

    def controller(self) -> tuple[int, str]:
        return self.cli("run", "--lab", str(self.lab), "--interval", "0.2")

    def start_bystander(self) -> None:
        if self.bystander is None or self.bystander.poll() is not None:
            self.bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)",
                                               self.bystander_tag], stdin=subprocess.DEVNULL,
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def _is_lab_process(self, pid: int) -> bool:
        cmd = _cmdline(pid)
        return (str(self.lab) in cmd or str(self.cache) in cmd) and "adv" + "mark-" not in cmd

    def _stragglers(self, mark: str, short: str) -> list[int]:
        found = []
        for pid in _pids():
            if pid == os.getpid():
                continue
            if self.bystander is not None and pid == self.bystander.pid:
                continue
            cmd = _cmdline(pid)
            env = _read(f"/proc/{pid}/environ").decode("utf-8", "replace")
            comm = _read(f"/proc/{pid}/comm").decode("utf-8", "replace").strip()
            if mark in cmd or mark in env or comm == short:
                found.append(pid)
            elif _uid(pid) == SANDBOX_UID and self._orphan_or_ours(pid):
                found.append(pid)
        return [p for p in found if _state(p) not in ("Z", "")]

    def _orphan_or_ours(self, pid: int) -> bool:
        """A sandbox-uid process counts as ours unless a live bwrap of someone else's run holds it."""
        p = _ppid(pid)
        for _ in range(32):
            if p <= 1:
                return True
            cmd = _cmdline(p)
            if str(self.lab) in cmd or str(self.cache) in cmd:
                return True
            if "bwrap" in cmd.split(" ")[0]:
                # a sandbox that is still alive: ours only if its harness is ours
                q = _ppid(p)
                return str(self.lab) in _cmdline(q) or str(self.cache) in _cmdline(q)
            p = _ppid(p)
        return True

    def wait_quiet(self, mark: str, short: str) -> list[int]:
        """Wait for the lab's own processes (harness, evaluator) to finish, then up to STRAGGLER_WAIT
        for anything of the candidate; kill and return what is still there."""
        deadline = time.time() + LAB_PROCESS_WAIT
        while time.time() < deadline and any(self._is_lab_process(p) for p in _pids() if p != os.getpid()):
            time.sleep(0.2)
        lab_left = [p for p in _pids() if p != os.getpid() and self._is_lab_process(p)]
        deadline = time.time() + STRAGGLER_WAIT
        left = self._stragglers(mark, short)
        while left and time.time() < deadline:
            time.sleep(0.25)
            left = self._stragglers(mark, short)
        for _ in range(20):  # a fork bomb's children: kill until none is left
            now = self._stragglers(mark, short) + [p for p in _pids() if p != os.getpid() and self._is_lab_process(p)]
            if not now:
                break
            _kill(now)
            time.sleep(0.1)
        return left + [p for p in lab_left if p not in left]

    # -- set-up -----------------------------------------------------------------------------------------
    def setup(self) -> None:
        for d in (self.home, self.hits, self.cache):
            d.mkdir(parents=True, exist_ok=True)
        (self.home / ".cache" / "huggingface").mkdir(parents=True)
        (self.home / ".cache" / "huggingface" / "token").write_text(self.canaries["~/.cache/huggingface/token"])
        (self.home / ".ssh").mkdir()
        (self.home / ".ssh" / "id_ed25519").write_text(
            "-----BEGIN OPENSSH PRIVATE KEY-----\n" + self.canaries["~/.ssh/id_ed25519"] + "\n-----END-----\n")
        self.listener = Listener()
        self.start_bystander()
        for attempt in range(BASELINE_ATTEMPTS):
            # --min-delta 0: a lab that promotes any improvement, the easiest one for a false
            # metric to get into the master (a lab made by `autolab init` judges in pairs,
            # one at a time, and a win must show in them).
            rc, out = self.cli("init", str(self.lab), "--profile", "tiny", "--data", "synthetic", "--budget", str(BUDGET),
                               "--min-delta", "0")
            assert rc == 0, f"autolab init failed:\n{out}"
            rc, out = self.controller()  # measures the master (the baseline)
            master = self.master()
            assert rc == 0 and master.get("val_bpb") is not None, f"the baseline run failed:\n{out}\n{self.logs_tail()}"
            self.baseline = float(master["val_bpb"])
            # Every check compares with the baseline, so it must have trained as an honest run does. On a
            # machine loaded by other tests a 2-s budget may train a step or two (val_bpb ~2.3, not ~0.65),
            # and an honest control would then look like a false metric: measure it again on a fresh lab.
            if self._baseline_tokens() >= MIN_BASELINE_TOKENS or attempt == BASELINE_ATTEMPTS - 1:
                break
            shutil.rmtree(self.lab)
            time.sleep(2.0)
        # Bystanders of every check: another experiment's worktree, another run's directory.
        subprocess.run(["git", "-C", str(self.lab), "worktree", "add", "-q", "--detach",
                        str(self.lab / ".autolab" / "worktrees" / "zz-bystander"), "HEAD"],
                       check=True, capture_output=True)
        # ...and another experiment's checked spec (what the engine runs instead of its file).
        specs = self.lab / ".autolab" / "specs"
        specs.mkdir(parents=True, exist_ok=True)
        (specs / "zz-bystander.json").write_text(json.dumps({
            "hypothesis": "A bystander checked before this candidate ran.", "parent": "seed",
            "diff": "--- a/train.py\n+++ b/train.py\n"}) + "\n")
        shutil.copytree(specs, self.pristine_specs, dirs_exist_ok=True)
        canary_run = self.lab / ".autolab" / "runs" / "zz-canary-run"
        canary_run.mkdir(parents=True)
        (canary_run / "log.txt").write_text(f"a log another run wrote: {self.canaries['another run' + chr(39) + 's log']}\n")
        # Pristine copies to put things back after each candidate.
        self.pristine.mkdir()
        shutil.copytree(self.cache, self.pristine / "cache", symlinks=True)
        shutil.copytree(self.home, self.pristine / "home", symlinks=True)
        shutil.copytree(self.lab / ".git" / "hooks", self.pristine / "hooks", symlinks=True)
        shutil.copy2(self.lab / ".git" / "config", self.pristine / "config")
        for f in ("lab.yaml", "research/notes.md"):
            (self.pristine / "lab" / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(self.lab / f, self.pristine / "lab" / f)
        harness = self.lab / ".autolab" / "harness"
        if harness.exists():
            shutil.copytree(harness, self.pristine / "harness", symlinks=True)

    def _baseline_tokens(self) -> int:
        """Training tokens the harness served the baseline run (0 if its result is unreadable)."""
        for result in (self.lab / ".autolab" / "runs").glob("baseline-*/result.json"):
            try:
                return int(1e6 * float(json.loads(result.read_text())["metrics"]["total_tokens_M"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return 0

    def teardown(self) -> None:
        if self.listener:
            self.listener.close()
        if self.bystander and self.bystander.poll() is None:
            self.bystander.kill()
            self.bystander.wait()
        _kill([p for p in _pids() if p != os.getpid() and (self._is_lab_process(p) or "advmark-" in _cmdline(p))])

    def logs_tail(self, n: int = 4000) -> str:
        out = []
        for log in sorted((self.lab / ".autolab" / "runs").glob("*/log.txt")):
            out.append(f"--- {log}\n" + log.read_text(errors="replace")[-n:])
        return "\n".join(out)

    # -- reading the lab ------------------------------------------------------------------------------
    def master(self) -> dict:
        return json.loads((self.lab / "research" / "live" / "master.json").read_text())

    def master_source(self) -> str:
        return subprocess.run(["git", "-C", str(self.lab), "show", f"{self.master()['commit']}:bench/train.py"],
                              capture_output=True, text=True, check=True).stdout

    def record(self, name: str) -> dict:
        p = self.lab / ".autolab" / "status" / f"{name}.json"
        try:
            return json.loads(p.read_text()).get("status") or {}
        except (OSError, ValueError):
            return {}

    def refs(self) -> dict[str, str]:
        out = subprocess.run(["git", "-C", str(self.lab), "for-each-ref", "--format=%(refname) %(objectname)"],
                             capture_output=True, text=True).stdout
        return dict(line.split(" ", 1) for line in out.splitlines() if line.strip())

    def site_dirs(self) -> list[Path]:
        dirs = [Path(p) for p in site.getsitepackages()] + [Path(site.getusersitepackages())]
        dirs += list(self.home.glob(".local/lib/python*/site-packages"))
        return [d for d in dirs if d.is_dir()]

    def snapshot(self, name: str) -> dict:
        lab = self.lab
        run = f"exp-{name}-1"
        status = {p.name: p.read_bytes() for p in (lab / ".autolab" / "status").glob("*.json")
                  if p.name != f"{name}.json"} if (lab / ".autolab" / "status").exists() else {}
        return {
            "ledger": (lab / "research" / "results.tsv").read_bytes(),
            "master": (lab / "research" / "live" / "master.json").read_bytes(),
            "refs": self.refs(),
            "worktrees": tree(lab / ".autolab" / "worktrees", skip=(name,)),
            "specs": tree(lab / ".autolab" / "specs", skip=(f"{name}.json",)),
            "bench": tree(lab / "bench", keep_bytes=1 << 22),
            "harness": tree(lab / ".autolab" / "harness"),
            "cache": tree(self.cache, skip=("last_source",)),
            "last_source": _read(self.cache / "last_source"),
            "experiments": sorted(str(p.relative_to(lab / "experiments")) for p in (lab / "experiments").rglob("*")),
            "home": tree(self.home),
            "git": {**tree(lab / ".git" / "hooks"), "config": _sha(lab / ".git" / "config"),
                    **{f"info/{k}": v for k, v in tree(lab / ".git" / "info").items()}},
            "labfiles": {f: _sha(lab / f) for f in ("lab.yaml", "research/notes.md", ".gitignore")},
            "status": status,
            "runs": tree(lab / ".autolab" / "runs", skip=(run,), keep_bytes=1 << 20),
            "site": {str(d): sorted(os.listdir(d)) for d in self.site_dirs()},
        }

    # -- one candidate ----------------------------------------------------------------------------------
    def run_candidate(self, cand: A.Candidate) -> Outcome:
        name = cand.name
        short = "adv" + secrets.token_hex(5)
        mark = f"advmark-{name}-{secrets.token_hex(6)}"
        ctx = {"NAME": name, "MARK": mark, "SHORT": short, "HITS": str(self.hits),
               "PORT": str(self.listener.port), "PIDNS": self.pidns, "BYSTANDER": self.bystander_tag}
        master = self.master()
        src = self.master_source()
        new = cand.build(src, ctx)
        import difflib
        diff = "".join(difflib.unified_diff(src.splitlines(True), new.splitlines(True), "a/train.py", "b/train.py"))
        spec = {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment", "metadata": {"name": name},
                "spec": {"campaign": "adversarial", "hypothesis": f"{name}: {cand.attack}"[:1900],
                         "parent": master["hash"][:12], "diff": diff}}
        self.start_bystander()
        self.listener.received = b""
        before = self.snapshot(name)
        (self.lab / "experiments" / f"{name}.yaml").write_text(yaml.safe_dump(spec, sort_keys=False, width=100))
        t0 = time.time()
        rc, out = self.controller()
        first_rc = rc
        left = self.wait_quiet(mark, short)
        if self.record(name).get("phase") not in TERMINAL:  # e.g. the controller was killed: adopt and finish
            rc2, out2 = self.controller()
            out += "\n[rig] second `autolab run`:\n" + out2
            left += [p for p in self.wait_quiet(mark, short) if p not in left]
        seconds = time.time() - t0
        after = self.snapshot(name)
        res = Outcome(name, cand.cls, seconds=seconds)
        st = self.record(name)
        res.phase, res.outcome, res.reason = st.get("phase"), st.get("outcome"), st.get("reason")
        res.message = st.get("message") or ""
        res.val_bpb = _float((st.get("metrics") or {}).get("val_bpb"))
        try:
            res.violations = self.check(cand, mark, st, before, after, out, first_rc, left)
        finally:
            self.restore(cand, mark, short, before, after)
        self.report.append(res.row())
        return res

    # -- the checks ---------------------------------------------------------------------------------------
    def check(self, cand: A.Candidate, mark: str, st: dict, before: dict, after: dict, out: str,
              first_rc: int, left: list[int]) -> list[str]:
        v: list[str] = []
        name, lab, base = cand.name, self.lab, self.baseline
        run_dir = lab / ".autolab" / "runs" / f"exp-{name}-1"
        phase, outcome, reason = st.get("phase"), st.get("outcome"), st.get("reason")
        message = st.get("message") or ""
        metrics = st.get("metrics") or {}
        try:
            result = json.loads((run_dir / "result.json").read_text())
        except (OSError, ValueError):
            result = {}
        head, rows = _ledger(lab / "research" / "results.tsv")
        mine = [r for r in rows if r.get("experiment_id") == name]

        if phase not in TERMINAL:
            v.append(f"the experiment did not finish (phase {phase!r})")
        # (a) no false metric
        honest = cand.expect == "honest"
        if not honest and outcome == "Promoted":
            v.append(f"(a) the attack was Promoted (val_bpb {metrics.get('val_bpb')}, baseline {base:.4f})")
        vals = [(f"ledger row {r.get('run_id')}", _float(r.get("val_bpb"))) for r in mine]
        vals.append(("status metrics", _float(metrics.get("val_bpb"))))
        for where, val in vals:
            if val is not None and (not math.isfinite(val) or val < base - 0.5):
                v.append(f"(a) {where} records val_bpb {val} (baseline {base:.4f}): a false metric")
        budget_said = ("budget" in message.lower() or reason == "BudgetExceeded"
                       or result.get("reason_code") == "BudgetExceeded")
        if cand.expect == "budget" and not (phase == "Failed" and budget_said):
            v.append(f"(a) a budget attack must fail for the budget (BudgetExceeded); got {phase}/{outcome} "
                     f"({reason}): {message[:200]}")
        # A model whose output depends on state (a call counter) may equally be refused before it is scored.
        if cand.expect == "causal" and not (phase == "Failed" and reason in ("NotCausal", "ExportRefused")):
            v.append(f"(a) a non-causal model must fail the causality check or be refused; got {phase}/{outcome} ({reason}): "
                     f"{message[:200]}")
        if cand.expect == "no_gain":
            val = _float(metrics.get("val_bpb"))
            if phase == "Succeeded" and (val is None or val <= base + 0.5):
                v.append(f"(a) training after `done` counted: val_bpb {val} was measured on the model trained after "
                         f"the clock stopped (the export taken at `done` is untrained: > {base + 0.5:.2f})")
        if honest:
            val = _float(metrics.get("val_bpb"))
            if phase != "Succeeded" or val is None or not (base - 0.5 <= val <= base + 1.0):
                v.append(f"the honest control was not measured: {phase}/{outcome} val_bpb {val} ({reason}): "
                         f"{message[:300]}")
        if len(mine) != 1 and phase in TERMINAL:
            v.append(f"the ledger has {len(mine)} rows for the experiment (expected exactly one)")

        # (b) the lab is unchanged apart from the experiment's own row and branch
        old_lines = before["ledger"].splitlines(True)
        new_lines = after["ledger"].splitlines(True)
        if new_lines[:len(old_lines)] != old_lines:
            v.append("(b) earlier ledger rows changed: research/results.tsv is not append-only")
        extra = new_lines[len(old_lines):]
        if len(extra) > 1 or any(f"\t{name}\t".encode() not in line for line in extra):
            v.append(f"(b) the ledger gained rows that are not this experiment's: {[l[:80] for l in extra]}")
        promoted_ok = honest and outcome == "Promoted"
        if before["master"] != after["master"] and not promoted_ok:
            v.append("(b) research/live/master.json changed")
        refs_b, refs_a = dict(before["refs"]), dict(after["refs"])
        own = f"refs/heads/autolab/exp/{name}"
        refs_a.pop(own, None)
        refs_b.pop(own, None)
        if promoted_ok:
            refs_a.pop("refs/heads/autolab/master", None)
            refs_b.pop("refs/heads/autolab/master", None)
        if refs_b != refs_a:
            changed = sorted(k for k in set(refs_a) | set(refs_b) if refs_a.get(k) != refs_b.get(k))
            v.append(f"(b) git refs changed: {changed}")
        for key, what in (("worktrees", "other experiments' worktrees"),
                          ("specs", "other experiments' checked specs"), ("bench", "the lab's bench/"),
                          ("harness", "the pinned harness"), ("cache", "the data/compile cache (AUTOLAB_CACHE)"),
                          ("home", "HOME"), ("git", ".git hooks/config"), ("runs", "other runs' directories")):
            d = tree_diff(before[key], after[key])
            if d:
                v.append(f"(b) {what} changed: {d[:8]}")
        if before["last_source"] != after["last_source"]:
            v.append("(b) the cache's last_source changed")
        if before["labfiles"] != after["labfiles"]:
            v.append(f"(b) lab files changed: {[k for k in before['labfiles'] if before['labfiles'][k] != after['labfiles'][k]]}")
        new_specs = sorted(set(after["experiments"]) - set(before["experiments"]) - {f"{name}.yaml"})
        if new_specs:
            v.append(f"(b) experiments/ gained files: {new_specs}")
        changed_status = sorted(k for k in set(before["status"]) | set(after["status"])
                                if before["status"].get(k) != after["status"].get(k))
        if changed_status:
            v.append(f"(b) other experiments' status records changed: {changed_status}")
        planted = {d: sorted(set(after["site"].get(d, [])) - set(before["site"].get(d, []))) for d in after["site"]}
        planted = {d: n for d, n in planted.items() if n}
        if planted:
            v.append(f"(b) files appeared in the Python installation: {planted}")
        marked = self.marked_files(name, mark)
        if marked:
            v.append(f"(b) files carrying the candidate's marker outside its run: {marked[:8]}")

        # (c) no process left
        if left:
            v.append(f"(c) {len(left)} process(es) outlived the run: "
                     f"{[(p, _cmdline(p)[:80] or '(gone)') for p in left[:5]]}")

        # (d) injected code never ran; the attack never worked; no secret leaked
        hits = sorted(p.name for p in self.hits.glob(f"{mark}*"))
        if hits:
            v.append(f"(d) code the candidate injected ran in a trusted process: {hits[:5]}")
        needles = [f"ADV-HIT {mark}", f"HIDDEN-RAN {mark}", *self.canaries.values()]
        found: dict[str, list[str]] = {}
        places = [p for p in run_dir.rglob("*") if p.is_file()] if run_dir.exists() else []
        places += [lab / ".autolab" / "status" / f"{name}.json", lab / "research" / "results.tsv",
                   lab / "research" / "experiments" / f"{name}.md"]
        for p in places:
            for n in _contains(p, needles):
                found.setdefault(n, []).append(str(p.relative_to(lab)) if p.is_relative_to(lab) else str(p))
        for n in needles:
            if n in out:
                found.setdefault(n, []).append("controller output")
        for n, where in found.items():
            label = next((k for k, c in self.canaries.items() if c == n), None)
            if label:
                v.append(f"(d) a secret ({label}) leaked into {where}")
            elif n.startswith("HIDDEN-RAN"):
                v.append(f"(d) code hidden from the hashed text ran (seen in {where})")
            else:
                lines = [l for l in _read(run_dir / "log.txt", LOG_LIMIT).decode(errors="replace").splitlines()
                         if n in l][:2]
                v.append(f"(d) the attack worked: {lines or where}")

        # extra checks
        if "controller" in cand.checks and first_rc != 0:
            v.append(f"the controller did not survive the run (exit code {first_rc})")
        if "bystander" in cand.checks and (self.bystander is None or self.bystander.poll() is not None):
            v.append("a process outside the lab (the bystander) was killed")
        if "network" in cand.checks and mark.encode() in self.listener.received:
            v.append("(d) the candidate reached a TCP server on 127.0.0.1")
        if True:  # every candidate: no file of its run may grow past LOG_LIMIT
            big = [(str(p.name), p.stat().st_size) for p in places if p.exists() and p.stat().st_size > LOG_LIMIT]
            if big:
                v.append(f"files of the run grew past {LOG_LIMIT >> 20} MiB: {big}")
        if "stats" in cand.checks:
            v += self._check_stats(cand, metrics, mine, result)
        if "junk" in cand.checks and reason in ("InfrastructureError", "HarnessError", "RunsLost"):
            v.append(f"junk statistics broke the harness: {reason}: {message[:200]}")
        return v

    def _check_stats(self, cand: A.Candidate, metrics: dict, rows: list[dict], result: dict) -> list[str]:
        v = []
        forged = cand.forged_stats or {}
        measured = ("training_seconds", "total_seconds", "total_tokens_M", "num_params_M", "mfu_percent")
        self_reported = set(result.get("self_reported") or ())

        def close(a, b) -> bool:
            return a is not None and b is not None and abs(a - b) <= 0.011 + 1e-3 * abs(b)

        sources = [("status", metrics)] + [(f"ledger {r.get('run_id')}", r) for r in rows]
        for where, m in sources:
            for key, fval in forged.items():
                val = _float(m.get(key))
                if not close(val, fval):
                    continue
                if key in measured:
                    v.append(f"(a) {where} records the candidate's forged {key}={fval} as a harness figure")
                elif key not in self_reported:
                    v.append(f"(a) {where} records the candidate's {key}={fval} without marking it self-reported")
            for key in ("val_bpb", "training_seconds", "total_seconds", "peak_vram_mb", "mfu_percent",
                        "total_tokens_M", "num_steps", "num_params_M", "depth"):
                raw = m.get(key)
                if raw in (None, ""):
                    continue
                val = _float(raw)
                if val is None or not math.isfinite(val):
                    v.append(f"(a) {where} records a non-number for {key}: {raw!r}")
                elif key not in self_reported and val < 0:
                    v.append(f"(a) {where} records a negative {key}: {raw!r}")
        return v

    def marked_files(self, name: str, mark: str) -> list[str]:
        """Files carrying the marker outside the candidate's own run, record, spec and branch."""
        allowed = {
            self.lab / ".autolab" / "runs" / f"exp-{name}-1",
            self.lab / ".autolab" / "worktrees" / name,
            self.lab / ".autolab" / "status" / f"{name}.json",
            self.lab / ".autolab" / "specs" / f"{name}.json",  # the spec it was checked with
            self.lab / ".autolab" / "events" / f"{name}.jsonl",
            self.lab / ".autolab" / "deleted",
            self.lab / ".autolab" / "trackio",
            self.lab / "experiments" / f"{name}.yaml",
            self.lab / "research" / "experiments" / f"{name}.md",
            self.lab / ".git",
            self.lab / "research" / "results.tsv",  # checked row by row above
            self.hits,  # checked as (d)
            self.pristine,
        }
        needle = mark.encode()
        found = []

        def scan(root: Path, recursive: bool = True) -> None:
            if not root.exists():
                return
            it = os.walk(root) if recursive else [(str(root), [], [e.name for e in os.scandir(root) if e.is_file()])]
            for dirpath, dirnames, filenames in it:
                dp = Path(dirpath)
                if any(dp == a or a in dp.parents for a in allowed):
                    dirnames[:] = []
                    continue
                dirnames[:] = [d for d in dirnames if dp / d not in allowed]
                for fn in filenames:
                    p = dp / fn
                    if p in allowed or p.is_symlink():
                        continue
                    try:
                        if p.stat().st_size > (1 << 20):
                            continue
                    except OSError:
                        continue
                    if mark in fn or needle in _read(p):
                        found.append(str(p))

        scan(self.base)  # the lab, the cache, HOME (pristine copies carry no marker)
        for d in self.base.parents:  # what is above the lab (up to /tmp, or wherever the test runs)
            if str(d) in ("/", str(Path.home())):
                break
            scan(d, recursive=False)
        for d in SHARED_TMP:
            if os.path.isdir(d):
                try:
                    scan(Path(d), recursive=False)
                except OSError:
                    pass
        return found

    # -- putting the lab back ------------------------------------------------------------------------------
    @staticmethod
    def _put_back(root: Path, snap: dict, skip: tuple[str, ...] = ()) -> None:
        """Make the files under root what snap (a tree(..., keep_bytes) snapshot) says they were."""
        now = tree(root, skip=skip)
        for rel in set(now) - set(snap):
            p = root / rel
            if p.is_symlink() or p.is_file():
                p.unlink()
        for rel, (digest, data, mtime) in snap.items():
            p = root / rel
            if now.get(rel) != digest and data is not None:
                if p.is_symlink():
                    p.unlink()
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)
                if mtime is not None:  # a .pyc is valid only for its source's mtime
                    os.utime(p, ns=(mtime, mtime))

    def restore(self, cand: A.Candidate, mark: str, short: str, before: dict, after: dict) -> None:
        lab, name = self.lab, cand.name
        git = ["git", "-C", str(lab)]
        # processes first: nothing may keep writing while we clean up
        _kill(self._stragglers(mark, short))
        # refs and master (unless an honest control was promoted)
        honest_promoted = cand.expect == "honest" and self.record(name).get("outcome") == "Promoted"
        refs_now = self.refs()
        for ref, sha in before["refs"].items():
            if ref == "refs/heads/autolab/master" and honest_promoted:
                continue
            if refs_now.get(ref) != sha:
                subprocess.run(git + ["update-ref", ref, sha], capture_output=True)
        for ref in refs_now:
            if ref not in before["refs"] and ref != f"refs/heads/autolab/exp/{name}":
                subprocess.run(git + ["update-ref", "-d", ref], capture_output=True)
        if not honest_promoted and after["master"] != before["master"]:
            (lab / "research" / "live" / "master.json").write_bytes(before["master"])
        # the ledger: earlier rows as they were, plus this experiment's first row
        head, rows = _ledger(lab / "research" / "results.tsv")
        old = before["ledger"].splitlines(True)
        new = after["ledger"].splitlines(True)
        keep = [l for l in new[len(old):] if f"\t{name}\t".encode() in l][:1]
        if new != old + keep:
            (lab / "research" / "results.tsv").write_bytes(b"".join(old + keep))
        # bench/, lab files, .git hooks and config, the pinned harness
        self._put_back(lab / "bench", before["bench"])
        for f in ("lab.yaml", "research/notes.md"):
            shutil.copy2(self.pristine / "lab" / f, lab / f)
        shutil.rmtree(lab / ".git" / "hooks", ignore_errors=True)
        shutil.copytree(self.pristine / "hooks", lab / ".git" / "hooks", symlinks=True)
        shutil.copy2(self.pristine / "config", lab / ".git" / "config")
        if (self.pristine / "harness").exists() and tree_diff(before["harness"], after["harness"]):
            shutil.rmtree(lab / ".autolab" / "harness", ignore_errors=True)
            shutil.copytree(self.pristine / "harness", lab / ".autolab" / "harness", symlinks=True)
        # other experiments' checked specs
        if tree_diff(before["specs"], after["specs"]):
            for f in (lab / ".autolab" / "specs").glob("*.json"):
                if f.name != f"{name}.json":
                    f.unlink()
            shutil.copytree(self.pristine_specs, lab / ".autolab" / "specs", dirs_exist_ok=True)
        # other worktrees
        for wt in (lab / ".autolab" / "worktrees").glob("*"):
            if wt.name != name and (wt / ".git").exists():
                subprocess.run(["git", "-C", str(wt), "checkout", "-q", "--", "."], capture_output=True)
                subprocess.run(["git", "-C", str(wt), "clean", "-fdxq"], capture_output=True)
        # the cache and HOME from their pristine copies
        for live, copy, key in ((self.cache, self.pristine / "cache", "cache"), (self.home, self.pristine / "home", "home")):
            now = tree(live, skip=("last_source",) if key == "cache" else ())
            ref = tree(copy, skip=("last_source",) if key == "cache" else ())
            for rel in set(now) - set(ref):
                p = live / rel
                if p.is_symlink() or p.is_file():
                    p.unlink()
            for rel in ref:
                if now.get(rel) != ref[rel]:
                    (live / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(copy / rel, live / rel)
        if after["last_source"] != before["last_source"]:
            (self.cache / "last_source").write_bytes(before["last_source"])
        # other runs' directories and status records
        self._put_back(lab / ".autolab" / "runs", before["runs"], skip=(f"exp-{name}-1",))
        for fname, data in before["status"].items():
            p = lab / ".autolab" / "status" / fname
            if not p.exists() or p.read_bytes() != data:
                p.write_bytes(data)
        # specs that appeared (and whatever the controller made of them)
        for rel in set(after["experiments"]) - set(before["experiments"]) - {f"{name}.yaml"}:
            p = lab / "experiments" / rel
            if p.is_file():
                p.unlink()
            stem = Path(rel).stem
            (lab / ".autolab" / "status" / f"{stem}.json").unlink(missing_ok=True)
            subprocess.run(git + ["update-ref", "-d", f"refs/heads/autolab/exp/{stem}"], capture_output=True)
        # planted files in the Python installation and shared temporary directories
        for d in self.site_dirs():
            for p in d.iterdir():
                if short in p.name or mark in p.name or (
                        p.name in ("sitecustomize.py", "usercustomize.py") and mark.encode() in _read(p)):
                    p.unlink()
        for f in self.marked_files(name, mark):
            try:
                os.unlink(f)
            except OSError:
                pass
        for p in self.hits.glob(f"{mark}*"):
            p.unlink()
        self.start_bystander()
