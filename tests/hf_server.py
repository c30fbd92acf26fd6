"""A stand-in for the Hugging Face Jobs service, on 127.0.0.1, for the real huggingface_hub client.

It serves the endpoints `HfApi` calls (checked against huggingface_hub
2.4.0's source): `GET /api/whoami-v2`, `POST /api/jobs/{ns}` (create),
`GET /api/jobs/{ns}` (list, `label=k=v` and `stage=S` filters),
`GET /api/jobs/{ns}/{id}` (inspect), `GET /api/jobs/{ns}/{id}/logs`
(server-sent events, `data: {"timestamp", "data"}`), `POST
/api/jobs/{ns}/{id}/cancel`, `GET /api/jobs/hardware` and `GET
/api/buckets/{ns}/{name}`. Every request must carry the expected bearer
token; every request is recorded for the tests to inspect, and `calls()`
counts them per endpoint (what a run costs in API calls).

Like the real service it is strict where a client can misbehave: the log
endpoint streams live while the job runs (a `: keep-alive` comment every
`keepalive_seconds`, closed once the job has ended), so a client that follows
it opens one stream per job; `min_inspect_interval` answers an inspection of a
job that comes sooner than that after the last one with 429 and a
`Retry-After` (seconds, or an HTTP date with `retry_after_as_date`);
`throttle(n, seconds)` answers the next n calls so; `forbid(namespace)`
answers 403 for a namespace the token may not use; `stall_logs(job)` holds a
job's log stream open and silent (no line, no keep-alive) until
`unstall_logs(job)`, as a stuck proxy would. Its clock (`clock`) may be a
test's, shared with the backend, so rate limits hold in simulated time.

A created job is in SCHEDULING; the first inspection after `schedule_polls`
starts it. By default it then really runs: the job's command is executed on
this machine, `python3` standing for this interpreter, with only the job's
environment and secrets (plus PATH and HOME, as a container would have), and
bucket volumes "mounted" by rewriting their mount path to a local directory
in the command and environment. Its output becomes the job's log; when it
exits, its exit code decides COMPLETED or ERROR. A test may instead script the
next job (`script_next`): an ending stage and message, log lines, or a hold in
RUNNING until cancelled or `finish`ed.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable
from urllib.parse import parse_qsl, urlsplit

HARDWARE = [
    {"name": "cpu-upgrade", "prettyName": "CPU Upgrade", "cpu": "8 vCPU", "ram": "32 GB",
     "accelerator": None, "unitCostMicroUSD": 500, "unitCostUSD": 0.0005, "unitLabel": "minute"},
    {"name": "l4x1", "prettyName": "Nvidia 1xL4", "cpu": "8 vCPU", "ram": "30 GB",
     "accelerator": {"type": "gpu", "model": "L4", "quantity": "1", "vram": "24 GB",
                     "manufacturer": "Nvidia"},
     "unitCostMicroUSD": 13333, "unitCostUSD": 0.013333, "unitLabel": "minute"},
    {"name": "h200", "prettyName": "Nvidia 1xH200", "cpu": "23 vCPU", "ram": "256 GB",
     "accelerator": {"type": "gpu", "model": "H200", "quantity": "1", "vram": "141 GB",
                     "manufacturer": "Nvidia"},
     "unitCostMicroUSD": 83333, "unitCostUSD": 0.083333, "unitLabel": "minute"},
]


TERMINAL = ("COMPLETED", "ERROR", "CANCELED", "DELETED")


def endpoint_kind(method: str, path: str) -> str:
    """The API call a request is: whoami, hardware, bucket, create, list, inspect, logs, cancel."""
    if path == "/api/whoami-v2":
        return "whoami"
    if path == "/api/jobs/hardware":
        return "hardware"
    if path.startswith("/api/buckets/"):
        return "bucket"
    m = re.fullmatch(r"/api/jobs/([^/]+)(?:/([^/]+))?(?:/(logs|cancel))?", path)
    if not m:
        return "other"
    if m[2] is None:
        return "create" if method == "POST" else "list"
    return m[3] or "inspect"


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Script:
    """How a scripted job behaves instead of running its command."""

    stage: str = "COMPLETED"          # the stage it ends in (ignored when hold=True)
    message: str | None = None
    logs: list[str] | Callable[["FakeJob"], list[str]] = field(default_factory=list)
    hold: bool = False                # stay RUNNING until cancelled or finished
    running_polls: int = 1            # inspections in RUNNING before it ends
    stall_logs: bool = False          # its log stream stalls from the start


@dataclass
class FakeJob:
    id: str
    namespace: str
    spec: dict
    created: float
    stage: str = "SCHEDULING"
    message: str | None = None
    polls: int = 0
    logs: list[tuple[float, str]] = field(default_factory=list)
    script: Script | None = None
    proc: subprocess.Popen | None = None
    cancelled: bool = False
    stalled: bool = False             # the log stream says nothing until unstalled
    last_inspect: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def info(self, owner: str) -> dict:
        return {"id": self.id, "createdAt": _stamp(self.created),
                "dockerImage": self.spec.get("dockerImage"), "spaceId": self.spec.get("spaceId"),
                "command": self.spec.get("command"), "arguments": self.spec.get("arguments", []),
                "environment": self.spec.get("environment", {}),
                # The service never returns secret values, only their names.
                "secrets": {k: None for k in self.spec.get("secrets", {})},
                "flavor": self.spec.get("flavor"), "labels": self.spec.get("labels"),
                "volumes": self.spec.get("volumes"),
                "status": {"stage": self.stage, "message": self.message},
                "owner": {"id": "u-" + owner, "name": self.namespace, "type": "user"}}


class FakeJobsServer:
    def __init__(self, token: str, user: str = "alice", orgs: tuple[str, ...] = ("autolab-org",),
                 work_dir: Path | None = None):
        self.token = token
        self.user = user
        self.orgs = list(orgs)
        self.jobs: dict[str, FakeJob] = {}
        self.buckets: dict[str, Path] = {}
        self.requests: list[dict] = []
        self.schedule_polls = 1
        self.scripts: list[Script] = []
        self.extra_env: dict[str, str] = {}
        self.work_dir = work_dir
        self.python = sys.executable  # the job image's interpreter ("python" in a job's command)
        self.clock: Callable[[], float] = time.time
        self.keepalive_seconds = 30.0       # the real service's interval
        self.min_inspect_interval: float | None = None
        self.retry_after_seconds = 5
        self.retry_after_as_date = False
        self.forbidden: dict[str, str] = {}  # namespace -> the server's message
        self.throttled: list[dict] = []     # the requests answered 429
        self._throttle: list[int] = []      # Retry-After seconds of the next forced 429s
        self._stopping = threading.Event()
        self._n = 0
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    # -- control --------------------------------------------------------------------------------
    def start(self) -> "FakeJobsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # streams close
        for job in self.jobs.values():
            if job.proc and job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)
                job.proc.wait()
        self.httpd.shutdown()
        self.httpd.server_close()

    def add_bucket(self, bucket_id: str, path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        self.buckets[bucket_id] = path
        return path

    def script_next(self, script: Script) -> None:
        self.scripts.append(script)

    def created(self) -> list[FakeJob]:
        return sorted(self.jobs.values(), key=lambda j: j.created)

    def calls(self) -> Counter:
        """API calls so far, per endpoint kind (see endpoint_kind)."""
        return Counter(r["kind"] for r in self.requests)

    def throttle(self, n: int = 1, seconds: int = 5) -> None:
        """Answer the next n API calls with 429 and `Retry-After: seconds`."""
        self._throttle.extend([seconds] * n)

    def forbid(self, namespace: str, message: str | None = None) -> None:
        self.forbidden[namespace] = message or (f"You don't have the rights to run jobs in the "
                                                f"namespace {namespace}")

    def stall_logs(self, job: FakeJob) -> None:
        job.stalled = True

    def unstall_logs(self, job: FakeJob) -> None:
        job.stalled = False

    def log(self, job: FakeJob, line: str) -> None:
        """A line the running job prints now."""
        self._log(job, line)

    def finish(self, job: FakeJob, stage: str = "COMPLETED", message: str | None = None,
               logs: list[str] | None = None) -> None:
        """End a held job: its last lines, then its stage."""
        with job.lock:
            for line in logs or []:
                self._log(job, line)
            job.stage, job.message = stage, message

    def hits(self, method: str, pattern: str) -> list[dict]:
        return [r for r in self.requests if r["method"] == method
                and re.fullmatch(pattern, r["path"])]

    def wait_finished(self, job: FakeJob, timeout: float = 120.0) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            self._advance(job)
            if job.stage in TERMINAL:
                return
            time.sleep(0.2)
        raise TimeoutError(f"job {job.id} still {job.stage} after {timeout}s")

    # -- the job's life -------------------------------------------------------------------------
    def _advance(self, job: FakeJob) -> None:
        with job.lock:
            job.polls += 1
            if job.stage == "SCHEDULING" and job.polls > self.schedule_polls:
                job.stage = "RUNNING"
                job.polls = 0
                self._log(job, f"===== Job started at {_stamp(time.time())} =====")
                if job.script is None:
                    self._execute(job)
                else:
                    logs = job.script.logs
                    for line in (logs(job) if callable(logs) else logs):
                        self._log(job, line)
            elif job.stage == "RUNNING" and job.script is not None and not job.script.hold:
                if job.polls >= job.script.running_polls:
                    job.stage, job.message = job.script.stage, job.script.message

    def _log(self, job: FakeJob, line: str) -> None:
        job.logs.append((time.time(), line))

    def _mount(self, job: FakeJob, text: str) -> str:
        for v in job.spec.get("volumes") or []:
            local = self.buckets.get(v["source"])
            if local is not None:
                text = text.replace(v["mountPath"], str(local))
        return text

    def _execute(self, job: FakeJob) -> None:
        cmd = [self._mount(job, c) for c in job.spec["command"]]
        if cmd[0] in ("python", "python3"):
            cmd[0] = str(self.python)
        home = Path(self.work_dir or "/tmp") / f"job-{job.id[-6:]}"
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "HOME": str(home), "TMPDIR": str(home / "tmp"), **self.extra_env}
        env.update({k: self._mount(job, str(v)) for k, v in job.spec.get("environment", {}).items()})
        env.update({k: str(v) for k, v in job.spec.get("secrets", {}).items()})
        job.proc = subprocess.Popen(cmd, env=env, cwd=str(home),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)

        def pump() -> None:
            for raw in iter(job.proc.stdout.readline, b""):
                self._log(job, raw.decode("utf-8", "replace").rstrip("\n"))
            job.proc.stdout.close()
            rc = job.proc.wait()
            with job.lock:  # the job ends when its process does, not when someone looks
                if job.stage == "RUNNING":
                    job.stage = "COMPLETED" if rc == 0 else "ERROR"
                    job.message = None if rc == 0 else f"Job failed with exit code: {rc}"

        threading.Thread(target=pump, daemon=True).start()

    def _cancel(self, job: FakeJob) -> None:
        with job.lock:
            job.cancelled = True
            if job.stage in ("SCHEDULING", "RUNNING"):
                job.stage, job.message = "CANCELED", "Canceled by user"
            if job.proc is not None and job.proc.poll() is None:
                os.killpg(job.proc.pid, signal.SIGKILL)

    def _create(self, namespace: str, spec: dict) -> FakeJob:
        with self._lock:
            self._n += 1
            job = FakeJob(id=f"{self._n:024x}", namespace=namespace, spec=spec,
                          created=time.time())
            if self.scripts:
                job.script = self.scripts.pop(0)
                job.stalled = job.script.stall_logs
            self.jobs[job.id] = job
        return job

    # -- HTTP -----------------------------------------------------------------------------------
    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, code: int, body, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                parts = urlsplit(self.path)
                query = parse_qsl(parts.query)
                body = None
                if method == "POST":
                    n = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(n) if n else b""
                    body = json.loads(raw) if raw else None
                request = {"method": method, "path": parts.path, "query": query, "body": body,
                           "authorization": self.headers.get("Authorization"),
                           "kind": endpoint_kind(method, parts.path), "at": server.clock()}
                server.requests.append(request)
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._json(401, {"error": "Invalid credentials in Authorization header"})
                if server._throttle:
                    return self._too_many(request, server._throttle.pop(0))
                path = parts.path
                if path == "/api/whoami-v2":
                    return self._json(200, {"type": "user", "name": server.user,
                                            "orgs": [{"name": o} for o in server.orgs],
                                            "auth": {"accessToken": {"displayName": "test",
                                                                     "role": "write"}}})
                if path == "/api/jobs/hardware":
                    return self._json(200, HARDWARE)
                m = re.fullmatch(r"/api/buckets/([^/]+)/([^/]+)", path)
                if m:
                    bucket = f"{m[1]}/{m[2]}"
                    if bucket not in server.buckets:
                        return self._json(404, {"error": "Bucket not found"},
                                          {"X-Error-Code": "RepoNotFound"})
                    files = [p for p in server.buckets[bucket].rglob("*") if p.is_file()]
                    return self._json(200, {"id": bucket, "private": True,
                                            "createdAt": _stamp(time.time()),
                                            "size": sum(p.stat().st_size for p in files),
                                            "totalFiles": len(files)})
                m = re.fullmatch(r"/api/jobs/([^/]+)(?:/([^/]+))?(?:/(logs|cancel))?", path)
                if not m:
                    return self._json(404, {"error": f"no route {method} {path}"})
                ns, job_id, action = m.groups()
                if ns in server.forbidden:
                    return self._json(403, {"error": server.forbidden[ns]})
                if job_id is None:
                    if method == "POST":
                        job = server._create(ns, body or {})
                        return self._json(200, job.info(server.user))
                    labels = [v.split("=", 1) for k, v in query if k == "label"]
                    stages = [v for k, v in query if k == "stage"]
                    out = [j.info(server.user) for j in server.created() if j.namespace == ns
                           and all((j.spec.get("labels") or {}).get(k) == v for k, v in labels)
                           and (not stages or j.stage in stages)]
                    return self._json(200, out)
                job = server.jobs.get(job_id)
                if job is None or job.namespace != ns:
                    return self._json(404, {"error": "Job not found"})
                if action == "cancel" and method == "POST":
                    server._cancel(job)
                    return self._json(200, {})
                if action == "logs":
                    return self._logs(job)
                now = server.clock()
                if server.min_inspect_interval is not None and job.last_inspect is not None \
                        and now - job.last_inspect < server.min_inspect_interval:
                    return self._too_many(request, server.retry_after_seconds)
                job.last_inspect = now
                server._advance(job)
                return self._json(200, job.info(server.user))

            def _too_many(self, request: dict, seconds: int) -> None:
                server.throttled.append(request)
                after = str(seconds) if not server.retry_after_as_date else \
                    email.utils.formatdate(server.clock() + seconds, usegmt=True)
                return self._json(429, {"error": "Too many requests, slow down"},
                                  {"Retry-After": after})

            def _logs(self, job: FakeJob) -> None:
                """Server-sent events: the log so far, then each new line as it comes, until the
                job has ended (a keep-alive comment now and then while it is quiet)."""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                sent, quiet_since = 0, time.monotonic()
                try:
                    while not server._stopping.is_set():
                        if job.stalled:
                            time.sleep(0.02)
                            continue
                        if job.stage == "SCHEDULING":  # a job starts whether or not it is
                            server._advance(job)       # inspected (here: when looked at)
                        ended = job.stage in TERMINAL  # read before the lines: none is lost
                        lines = job.logs[sent:]
                        for t, line in lines:
                            event = {"timestamp": _stamp(t), "data": line}
                            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                        sent += len(lines)
                        if lines:
                            self.wfile.flush()
                            quiet_since = time.monotonic()
                        if ended:
                            break
                        if time.monotonic() - quiet_since >= server.keepalive_seconds:
                            self.wfile.write(b": keep-alive\n\n")
                            self.wfile.flush()
                            quiet_since = time.monotonic()
                        time.sleep(0.02)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        return Handler


# --- what a genuine entry point prints, for scripted jobs ----------------------------------------

def _entry_module():
    import importlib.util
    path = Path(__file__).resolve().parents[1] / "bench" / "hf_entry.py"
    spec = importlib.util.spec_from_file_location("autolab_hf_entry_for_tests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def signed_line(job: FakeJob, result: dict, key: str | None = None, run: str | None = None) -> str:
    """The line bench/hf_entry.py prints, signed with the job's own secret key (or `key`)."""
    entry = _entry_module()
    key = key if key is not None else job.spec["secrets"]["AUTOLAB_RESULT_KEY"]
    run = run if run is not None else job.spec["labels"]["autolab-run"]
    return entry.sign_result(key.encode(), run, json.dumps(result, separators=(",", ":")))


def harness_result(val_bpb: float, candidate_sha1: str | None = None, status: str = "succeeded",
                   reason: str | None = None) -> dict:
    """A result in the shape bench/run.py writes."""
    metrics = {"val_bpb": val_bpb, "training_seconds": 2.0, "total_seconds": 9.5,
               "peak_vram_mb": 0.0, "mfu_percent": 0.0, "total_tokens_M": 0.01, "num_steps": 3,
               "num_params_M": 0.229, "depth": 2}
    return {"version": 1, "status": status, "reason": reason or f"val_bpb {val_bpb:.6f}",
            "exit_code": 0 if status == "succeeded" else 3, "candidate_sha1": candidate_sha1,
            "profile": "tiny", "source": "synthetic",
            "metrics": metrics if status == "succeeded" else None, "curve": None}


def shipped_files(job: FakeJob) -> dict[str, bytes]:
    """The files a job carries in its AUTOLAB_BUNDLE environment variables (AUTOLAB_BUNDLE,
    then AUTOLAB_BUNDLE_1, ... when it is long)."""
    import base64
    import io
    import tarfile
    env, i = job.spec["environment"], 1
    text = env["AUTOLAB_BUNDLE"]
    while f"AUTOLAB_BUNDLE_{i}" in env:
        text, i = text + env[f"AUTOLAB_BUNDLE_{i}"], i + 1
    with tarfile.open(fileobj=io.BytesIO(base64.b64decode(text)), mode="r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def genuine_result(job: FakeJob, val_bpb: float) -> list[str]:
    """Log lines of a job whose harness measured val_bpb for the candidate it was shipped."""
    import hashlib
    sha1 = hashlib.sha1(shipped_files(job)["bench/train.py"]).hexdigest()
    return ["[bench] training...", signed_line(job, harness_result(val_bpb, sha1))]


def signed_curve(job: FakeJob, points: list[dict], key: str | None = None) -> list[str]:
    """The step-curve lines bench/hf_entry.py prints, signed with the job's key (or `key`)."""
    entry = _entry_module()
    key = key if key is not None else job.spec["secrets"]["AUTOLAB_RESULT_KEY"]
    return entry.sign_curve(key.encode(), job.spec["labels"]["autolab-run"], points)
