"""The Hugging Face Jobs API as the backend calls it: errors, rate limits, the token, logs.

What the Hub answers, turned into what the backend can act on: a 401 or 403 into a sentence with
the fix (`refusal_message`), a 429 into a wait (`RateLimited`, `retry_after`: seconds or an HTTP
date, capped), a cluster Secret into a token (`token_from_secret`). And `LogReader`: one read of
a job's log (`fetch_job_logs`, which may block for minutes and cannot be interrupted) in a
daemon thread of its own, keeping the end of the log and the lines that carry our signed markers
(`hf_wire`), whatever the candidate prints. The run logic that decides when to call is `hf`'s
`HfBackend`.
"""

from __future__ import annotations

import base64
import email.utils
import threading
import time
from collections import deque
from typing import Any, Callable

from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from controller.backends import BackendConfigError
from controller.backends.hf_wire import CURVE_MARKER, MAX_CURVE_LINES, RESULT_MARKER
from controller.core.spec import SpecError

# What one read of a job's log keeps, whatever the candidate prints into it.
MAX_LOG_LINES = 20_000        # the end of the log, for log.txt
MAX_LINE_CHARS = 4096         # a longer line is cut in log.txt
MAX_MARKED_CHARS = 64 * 1024  # a longer line is no signed line of ours
MAX_RESULT_LINES = 64         # the last lines with the result marker (ours is the last)
RETRY_AFTER_MAX = 3600.0  # the longest wait a Retry-After may ask for


class HfBackendError(BackendConfigError, SpecError):
    """The lab's Hugging Face settings cannot work; the message says what to set. A SpecError
    to the code that reports a spec's problem, and the machine's to fix (a token, a Secret, a
    bucket: `BackendConfigError` comes first)."""



def token_from_secret(name: str, namespace: str, core_api: Any = None) -> str:
    """In a cluster: the token in key HF_TOKEN of the Secret the Lab names (spec.hf.tokenSecret)."""
    if core_api is None:
        from kubernetes import client
        core_api = client.CoreV1Api()
    secret = core_api.read_namespaced_secret(name, namespace)
    data = (secret.data or {}).get("HF_TOKEN")
    if not data:
        raise HfBackendError(f"Secret {namespace}/{name} has no key HF_TOKEN; create it with "
                             f"`kubectl -n {namespace} create secret generic {name} "
                             "--from-literal=HF_TOKEN=hf_...`")
    return base64.b64decode(data).decode().strip()


class RateLimited(Exception):
    """Hugging Face answered 429 (now or recently): no call before `seconds` have passed."""

    def __init__(self, seconds: float):
        super().__init__(seconds)
        self.seconds = seconds

    def message(self) -> str:
        return (f"Hugging Face asked for fewer API calls (429); the next one in "
                f"{self.seconds:.0f} s")


def retry_after(response: Any, now: float) -> float | None:
    """Seconds to wait from a 429's `Retry-After`, in seconds or as an HTTP date; None if absent
    or unreadable. At most RETRY_AFTER_MAX (a wrong date must not stop the lab for days)."""
    headers = getattr(response, "headers", None) or {}
    value = str(headers.get("Retry-After") or headers.get("retry-after") or "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_MAX)



def status_code(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return getattr(response, "status_code", None)


def server_message(e: Exception) -> str:
    """What the server said (huggingface_hub keeps it as `server_message`), else the error's
    last line."""
    said = (getattr(e, "server_message", None) or "").strip()
    if said:
        return " ".join(said.split())
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


def refusal_message(e: Exception, what: str, namespace: str | None) -> str:
    """A 401 or 403 from Hugging Face, told with the server's words and the fix."""
    code, said = status_code(e), server_message(e)
    if code == 401:
        return (f"Hugging Face rejected the token when asked to {what} (401: {said}); log in "
                "again with `hf auth login` or set HF_TOKEN to a valid token; `autolab hf "
                "preflight` checks it")
    where = f"namespace {namespace}" if namespace else "the jobs' namespace"
    return (f"Hugging Face refused to {what} in {where} (403: {said}). The token may not run "
            f"jobs there: use a token with write access to {namespace or 'it'} (a fine-grained "
            "token needs the permission to start and manage Jobs for that user or "
            "organisation, and for an organisation its user must be a member allowed to), log "
            "in with it (`hf auth login`, or HF_TOKEN), or set spec.hf.namespace in lab.yaml "
            "(or the Experiment's spec.hf.namespace) to a namespace the token may use, such as "
            "its own user; `autolab hf preflight` checks it")


class LogReader:
    """One read of a job's log in a daemon thread of its own, so no read holds up the loop.

    `fetch_job_logs` may block for minutes on a stream that says nothing (its read timeout
    is 120 s when following, 5 s when not) and cannot be interrupted; here it blocks only
    this thread. The reader keeps what the controller needs and no more, whatever the
    candidate prints: the last MAX_LOG_LINES lines (each cut to MAX_LINE_CHARS) and the last
    lines that carry one of our signed markers. Its times are the backend's clock.
    """

    def __init__(self, api: HfApi, job_id: str, namespace: str, *, follow: bool,
                 clock: Callable[[], float], on_rate_limit: Callable[[Exception], float]):
        self.api, self.job_id, self.namespace, self.follow = api, job_id, namespace, follow
        self.clock, self.on_rate_limit = clock, on_rate_limit
        self.tail: deque[str] = deque(maxlen=MAX_LOG_LINES)
        self.results: deque[str] = deque(maxlen=MAX_RESULT_LINES)
        self.curve: deque[str] = deque(maxlen=MAX_CURVE_LINES)
        self.count = 0
        self.started_at = clock()
        self.last_line_at: float | None = None
        self.result_at: float | None = None
        self.ended_at: float | None = None
        self.error: str | None = None
        self.timed_out = False  # it ended after a long silence: the read timed out
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True,
                                        name=f"hf-log-{job_id[-8:]}")

    def start(self) -> "LogReader":
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self.ended_at is None

    def silent_for(self, now: float) -> float:
        return now - (self.last_line_at if self.last_line_at is not None else self.started_at)

    def snapshot(self) -> tuple[list[str], list[str], list[str]]:
        with self._lock:
            return list(self.tail), list(self.results), list(self.curve)

    def trouble(self, now: float, stall_seconds: float) -> str | None:
        """What went wrong with this read, in words; None if it ended normally."""
        if self.alive and self.silent_for(now) >= stall_seconds:
            return f"the log stream stalled: no line for {self.silent_for(now):.0f} s"
        if self.error:
            return f"reading it failed: {self.error}"
        if self.timed_out:
            return "the log stream went silent until the read timed out"
        return None

    def _read(self) -> None:
        quiet = time.monotonic()
        try:
            for line in self.api.fetch_job_logs(job_id=self.job_id, namespace=self.namespace,
                                                follow=self.follow):
                quiet = time.monotonic()
                self._take(line)
        except HfHubHTTPError as e:
            if status_code(e) == 429:
                self.on_rate_limit(e)
            self.error = f"{status_code(e)} {server_message(e)}"
        except Exception as e:  # noqa: BLE001 - whatever the stream does, the read ends
            self.error = f"{type(e).__name__}: {e}"
        finally:
            # The client ends a silent no-follow read after 5 s (a followed one after 120 s).
            self.timed_out = time.monotonic() - quiet >= (100.0 if self.follow else 4.5)
            self.ended_at = self.clock()

    def _take(self, line: str) -> None:
        line = line.rstrip("\n")
        now = self.clock()
        with self._lock:
            self.count += 1
            self.last_line_at = now
            if len(line) <= MAX_MARKED_CHARS:
                if RESULT_MARKER in line:
                    self.results.append(line)
                    self.result_at = now
                elif CURVE_MARKER in line:
                    self.curve.append(line)
            self.tail.append(line if len(line) <= MAX_LINE_CHARS
                             else line[:MAX_LINE_CHARS] + " [line cut]")
