"""`autolab hf ...`: set up, check and watch a lab that runs on Hugging Face Jobs.

The backend itself (controller/backends/hf.py) is used by `autolab run` like
any other. These commands are for the person paying for it: `preflight`
shows, before anything is spent, who the token belongs to, the namespace,
the bucket, the lab's jobs in flight, the flavor's price and what one run
costs in time and money; `prepare` starts the one-time CPU job that fills
the bucket with the prepared data; `jobs` and `logs` show what is running
without opening a browser. The token is never printed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass

from typing import TYPE_CHECKING

from controller.cli import output as cli
from controller.lab import profiles
from controller.local import LocalLab

if TYPE_CHECKING:  # huggingface_hub is imported by the commands, not by every `autolab` call
    from controller.backends.hf import HfBackend

# Shown in --help without importing the backend; tests check they match its constants.
DEFAULT_FLAVOR = "h200"
DEFAULT_TIMEOUT = "30m"
PREPARE_FLAVOR = "cpu-upgrade"
PREPARE_TIMEOUT = "2h"

BOOT_ESTIMATE_SECONDS = 300  # image pull + installing torch on a fresh machine, roughly
EVAL_ESTIMATE_SECONDS = 60   # the harness's evaluation of the exported model, usually

HELP = "run experiments on Hugging Face Jobs: preflight, prepare, jobs, logs"
DESCRIPTION = """\
Run a lab's experiments on Hugging Face Jobs: rented GPUs, billed per minute a job runs.

What to set, once:
  1. A token with write access to the namespace: `hf auth login`, or HF_TOKEN in the
     environment. (In a cluster: a Secret holding key HF_TOKEN, named by spec.hf.tokenSecret.)
  2. In lab.yaml:   spec:
                      backend: hf
                      hf:
                        namespace: alice          # user or organisation (default: the token's user)
                        bucket: autolab-cache     # a private bucket for the prepared data
                        flavor: {flavor}              # hardware: h200, a100-large, l4x1, ... (default {flavor})
                        timeout: {timeout}              # the most one job may run (default {timeout})
     Create the bucket with `hf buckets create autolab-cache --private`. An Experiment may
     override flavor, timeout and namespace in its own spec.hf.
  3. `autolab hf prepare` fills the bucket: a one-time job on a CPU flavor ({prepare_flavor}).
  4. `autolab hf preflight` checks all of it and prints the price before you spend anything.
  Then `autolab run` as usual: every run (the master's baseline too) is one job.

What one run costs in time: the job boots (image pull and dependency install: a few
minutes on a fresh machine), trains for the lab's budget{budget}, may
spend up to the start-up allowance compiling{allowance}, and the harness evaluates
the exported model (about a minute{eval_timeout}). Expect budget + 5 to 10 minutes
of billed time per run; the timeout caps the worst case. preflight prints the numbers.
"""


def description() -> str:
    """DESCRIPTION, with the default profile's numbers from bench/prepare.py."""
    numbers = {"budget": "", "allowance": "", "eval_timeout": ""}
    try:
        p = profiles.profile(profiles.DEFAULT)
        numbers = {"budget": f" (default profile: {p.time_budget:g} s)",
                   "allowance": f" (default: {p.startup_allowance:g} s)",
                   "eval_timeout": f"; at most {p.eval_timeout / 60:g} minutes"}
    except profiles.ProfileError:  # help without the numbers rather than no help
        pass
    return DESCRIPTION.format(flavor=DEFAULT_FLAVOR, timeout=DEFAULT_TIMEOUT,
                              prepare_flavor=PREPARE_FLAVOR, **numbers)


@dataclass
class RunCost:
    budget: float
    startup_allowance: float
    eval_timeout: float

    @property
    def typical_seconds(self) -> float:
        return BOOT_ESTIMATE_SECONDS + self.budget + self.startup_allowance + EVAL_ESTIMATE_SECONDS

    @property
    def longest_seconds(self) -> float:
        return BOOT_ESTIMATE_SECONDS + self.budget + self.startup_allowance + self.eval_timeout


def run_cost(lab: LocalLab) -> RunCost:
    """The time one run may take, from the lab's own pinned harness (its profile's numbers in the
    first commit's bench/prepare.py, which the job runs). ProfileError if it cannot say."""
    profile = profiles.lab_profile(lab.root, lab.lab.profile, lab.lab.harness)
    return RunCost(float(lab.lab.budget_seconds or profile.time_budget),
                   profile.startup_allowance, profile.eval_timeout)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


def _token_source() -> str:
    if os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN"):
        return "HF_TOKEN"
    return "the token file (`hf auth login`)"


def _backend(lab: LocalLab) -> "HfBackend":
    return lab.backend_for("hf")


@contextlib.contextmanager
def _refusals(what: str, namespace: str | None):
    """A 401 or 403 from Hugging Face as one line: the server's words and the fix."""
    from huggingface_hub.errors import HfHubHTTPError

    from controller.backends.hf import refusal_message
    try:
        yield
    except HfHubHTTPError as e:
        if getattr(e.response, "status_code", None) not in (401, 403):
            raise
        raise cli.CliError(refusal_message(e, what, namespace)) from None


# --- preflight ----------------------------------------------------------------------------------

def cmd_preflight(a) -> int:
    import httpx2
    from huggingface_hub.errors import BucketNotFoundError, HfHubHTTPError

    from controller.backends.hf import DATA_MOUNT, LABEL_ROLE, LABEL_RUN, refusal_message, \
        timeout_seconds
    lab = LocalLab(a.lab)
    backend = _backend(lab)
    settings = backend.settings({"flavor": a.flavor} if a.flavor else None)
    problems: list[str] = []
    warnings: list[str] = []
    out = sys.stdout.write

    out(f"lab:        {lab.name} (id {backend.lab_id}), backend {lab.lab.backend}, "
        f"profile {lab.lab.profile}, data {lab.lab.data}\n")
    if lab.lab.backend != "hf":
        warnings.append("lab.yaml's spec.backend is not hf: only experiments with "
                        "`backend: hf` in their spec will run on Hugging Face")
    if lab.lab.data.startswith("dir:"):
        problems.append(f"data {lab.lab.data} is a path on this machine; jobs cannot read it "
                        "(use hub or synthetic)")
    if not backend.token():
        out("token:      none found\n")
        problems.append("no token: run `hf auth login` or set HF_TOKEN")
        return _verdict(problems, warnings)
    try:
        me = backend.whoami()
    except (HfHubHTTPError, httpx2.HTTPError, OSError) as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, HfHubHTTPError) and status in (401, 403):
            out(f"token:      from {_token_source()}, REJECTED ({status})\n")
            problems.append(f"whoami refused the token: {first}; log in again with "
                            "`hf auth login` or set HF_TOKEN")
        else:  # the Hub did not answer (no network, a wrong HF_ENDPOINT, a server error)
            out(f"token:      from {_token_source()}, NOT CHECKED (the Hub did not answer)\n")
            problems.append(f"cannot reach the Hub to check the token ({first}); check the "
                            "network and HF_ENDPOINT, then run again")
        return _verdict(problems, warnings)
    orgs = [o.get("name") for o in me.get("orgs") or [] if o.get("name")]
    out(f"token:      from {_token_source()}; user {me.get('name')}"
        + (f" (orgs: {', '.join(orgs)})" if orgs else "") + "\n")
    namespace = settings.namespace or me["name"]
    out(f"namespace:  {namespace}" + ("" if settings.namespace else " (the token's user)") + "\n")
    if namespace != me.get("name") and namespace not in orgs:
        problems.append(f"namespace {namespace} is neither the token's user nor one of its "
                        "organisations; set spec.hf.namespace to one of them")

    bucket = backend.bucket_id(settings, namespace)
    if not bucket:
        out("bucket:     none (spec.hf.bucket unset)\n")
        warnings.append("no bucket: every run prepares its data inside the job, billed; create "
                        "one (`hf buckets create autolab-cache --private`), name it in "
                        "spec.hf.bucket and run `autolab hf prepare`")
    else:
        try:
            info = backend.api.bucket_info(bucket)
            out(f"bucket:     {bucket}: {'private' if info.private else 'PUBLIC'}, "
                f"{info.total_files} files, {info.size / 1e6:.1f} MB; mounted read-only at "
                f"{DATA_MOUNT} in runs\n")
            if not info.private:
                warnings.append(f"bucket {bucket} is public: anyone can read the prepared data")
            if info.total_files == 0:
                warnings.append(f"bucket {bucket} is empty: run `autolab hf prepare` once")
        except BucketNotFoundError:
            out(f"bucket:     {bucket}: NOT FOUND\n")
            problems.append(f"bucket {bucket} does not exist (or the token cannot see it): "
                            f"`hf buckets create {bucket} --private`")
        except (HfHubHTTPError, httpx2.HTTPError) as e:
            out(f"bucket:     {bucket}: cannot check ({e})\n")

    price = None
    try:
        hardware = {h.name: h for h in backend.api.list_jobs_hardware()}
        hw = hardware.get(settings.flavor)
        if hw is None:
            problems.append(f"flavor {settings.flavor} is not offered; known flavors: "
                            f"{', '.join(sorted(hardware))}")
            out(f"flavor:     {settings.flavor}: UNKNOWN\n")
        else:
            acc = hw.accelerator
            gpu = f"{acc.quantity}x {acc.model} {acc.vram}" if acc else "no GPU"
            per_minute = hw.unit_cost_usd * (60 if hw.unit_label == "hour" else 1) \
                if hw.unit_label in ("minute", "hour") else None
            price = per_minute
            cost = f"${hw.unit_cost_usd:g} per {hw.unit_label}"
            out(f"flavor:     {settings.flavor} ({hw.pretty_name}, {gpu}, {hw.cpu}, {hw.ram}): "
                f"{cost}\n")
            if acc is None and lab.lab.profile == "default":
                warnings.append(f"flavor {settings.flavor} has no GPU; the default profile "
                                "needs one")
    except (HfHubHTTPError, httpx2.HTTPError) as e:
        out(f"flavor:     {settings.flavor} (price unavailable: {e})\n")

    try:
        active = backend.lab_jobs(namespace, active_only=True)
        out(f"in flight:  {len(active)} job(s) of this lab\n")
        for j in active:
            labels = j.labels or {}
            out(f"            {j.id}  {j.status.stage:<10} {labels.get(LABEL_RUN) or labels.get(LABEL_ROLE, '')}"
                f"  {j.flavor}\n")
    except HfHubHTTPError as e:
        if getattr(e.response, "status_code", None) in (401, 403):
            out(f"in flight:  REFUSED ({e.response.status_code}): the token may not use "
                f"namespace {namespace}\n")
            problems.append(refusal_message(e, "list the jobs", namespace))
        else:
            problems.append(f"listing the jobs in {namespace} failed: {str(e).splitlines()[0]}")
    except httpx2.HTTPError as e:
        problems.append(f"listing the jobs in {namespace} failed: {str(e).splitlines()[0]}")

    try:
        c = run_cost(lab)
    except profiles.ProfileError as e:  # the job would fail the same way, billed
        problems.append(f"cannot tell what one run costs: {e}")
        return _verdict(problems, warnings)
    limit = timeout_seconds(settings.timeout)
    out(f"one run:    boot ~{BOOT_ESTIMATE_SECONDS} s + training budget {c.budget:g} s + "
        f"start-up allowance {c.startup_allowance:g} s + evaluation ~{EVAL_ESTIMATE_SECONDS} s "
        f"(at most {c.eval_timeout:g} s)\n")
    typical = f"about {_minutes(c.typical_seconds)}"
    worst = f"at most {_minutes(limit)} (timeout {settings.timeout})"
    if price is not None:
        typical += f", about ${price * c.typical_seconds / 60:.2f}"
        worst += f", ${price * limit / 60:.2f}"
    out(f"            {typical}; {worst}\n")
    if limit < c.longest_seconds:
        warnings.append(f"timeout {settings.timeout} is shorter than the longest a run may "
                        f"legitimately take (~{_minutes(c.longest_seconds)}); a slow run would be "
                        "killed and recorded as an error")
    return _verdict(problems, warnings)


def _verdict(problems: list[str], warnings: list[str]) -> int:
    for w in warnings:
        sys.stdout.write(f"warning:    {w}\n")
    for p in problems:
        sys.stdout.write(f"problem:    {p}\n")
    sys.stdout.write("ready: yes\n" if not problems else "ready: no\n")
    return 0 if not problems else 1


# --- prepare ------------------------------------------------------------------------------------

def cmd_prepare(a) -> int:
    from controller.backends.hf import LABEL_ROLE
    lab = LocalLab(a.lab)
    backend = _backend(lab)
    settings = backend.settings()
    namespace = backend.namespace(settings)
    source = a.source or lab.lab.data
    with _refusals("list the jobs", namespace):
        running = [j for j in backend.lab_jobs(namespace, active_only=True)
                   if (j.labels or {}).get(LABEL_ROLE) == "prepare"]
    if running:
        job = running[0]
        print(f"a prepare job of this lab is already {job.status.stage}: {job.id} ({job.url})")
    else:
        with _refusals("create the prepare job", namespace):
            job = backend.submit_prepare(source, flavor=a.flavor, timeout=a.timeout)
        print(f"prepare job {job.id} on {a.flavor}: {source} for the {lab.lab.profile} profile "
              f"into bucket {backend.bucket_id(settings, namespace)} ({job.url})")
    if not a.wait:
        print(f"follow it with `autolab hf logs --job {job.id} -f --lab {a.lab}`")
        return 0
    return _follow(backend, job.id, namespace)


def _follow(backend: "HfBackend", job_id: str, namespace: str) -> int:
    from controller.backends.hf import ACTIVE_STAGES
    token = backend.token() or ""
    for line in backend.api.fetch_job_logs(job_id=job_id, namespace=namespace, follow=True):
        print(line.replace(token, "[redacted]") if token else line, flush=True)
    for _ in range(30):  # the stage may lag the last log line a little
        stage = str(backend.api.inspect_job(job_id=job_id, namespace=namespace).status.stage)
        if stage not in ACTIVE_STAGES:
            break
        time.sleep(1.0)
    print(f"job {job_id}: {stage}")
    return 0 if stage == "COMPLETED" else 1


# --- jobs and logs ------------------------------------------------------------------------------

def cmd_jobs(a) -> int:
    from controller.backends.hf import LABEL_ROLE, LABEL_RUN
    lab = LocalLab(a.lab)
    backend = _backend(lab)
    namespace = backend.namespace(backend.settings())
    with _refusals("list the jobs", namespace):
        jobs = backend.lab_jobs(namespace, active_only=not a.all)
    rows = []
    for j in sorted(jobs, key=lambda j: str(j.created_at or "")):
        labels = j.labels or {}
        rows.append([j.id, str(j.status.stage), labels.get(LABEL_ROLE, ""),
                     labels.get(LABEL_RUN, ""), str(j.flavor or ""),
                     j.created_at.strftime("%Y-%m-%d %H:%M") if j.created_at else ""])
    cli.print_table(["JOB", "STAGE", "ROLE", "RUN", "FLAVOR", "CREATED"], rows)
    return 0


def cmd_logs(a) -> int:
    lab = LocalLab(a.lab)
    backend = _backend(lab)
    if a.job:
        return _print_logs(backend, a.job, backend.namespace(backend.settings()), a.follow)
    if not a.name:
        raise cli.CliError("name an experiment (or --job ID)")
    record = lab.read_record(a.name)
    job = ((record.get("status") or {}).get("job") or {}) if record else {}
    if not job:
        raise cli.CliError(f"experiment {a.name!r} has no run (yet); see `autolab describe "
                           f"{a.name}`")
    if job.get("backend") != "hf":
        raise cli.CliError(f"experiment {a.name!r} ran on {job.get('backend')}; use "
                           f"`autolab logs {a.name}`")
    rec = backend.record(job["name"])
    saved = backend.log_path(job["name"])
    if not rec.get("jobId"):
        raise cli.CliError(f"run {job['name']} has no Hugging Face job on record on this machine")
    if saved.exists() and not a.follow:
        sys.stdout.write(saved.read_text())
        return 0
    return _print_logs(backend, rec["jobId"], rec["namespace"], a.follow)


def _print_logs(backend: "HfBackend", job_id: str, namespace: str, follow: bool) -> int:
    from huggingface_hub.errors import HfHubHTTPError
    token = backend.token() or ""
    try:
        with _refusals(f"show the logs of job {job_id}", namespace):
            for line in backend.api.fetch_job_logs(job_id=job_id, namespace=namespace,
                                                   follow=follow):
                # the candidate's output: its escape sequences are shown, never obeyed
                print(cli.printable(line.replace(token, "[redacted]") if token else line),
                      flush=True)
    except HfHubHTTPError as e:
        raise cli.CliError(f"cannot read the logs of job {job_id}: "
                           f"{str(e).strip().splitlines()[0]}") from None
    return 0


# --- registration -------------------------------------------------------------------------------

def add_commands(sub, add) -> None:
    def usage(a) -> int:
        sp.print_help()
        return 0

    sp = add("hf", usage, HELP, lab=False)
    sp.description = description()
    sp.formatter_class = argparse.RawDescriptionHelpFormatter
    hf_sub = sp.add_subparsers(dest="hf_command", metavar="COMMAND")

    def hf_add(name: str, fn, help_: str) -> argparse.ArgumentParser:
        p = hf_sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--lab", default=".", metavar="DIR", help="lab directory (default: .)")
        p.set_defaults(fn=fn)
        return p

    p = hf_add("preflight", cmd_preflight, "check token, namespace, bucket, flavor and jobs in "
                                           "flight; print what a run costs, before spending")
    p.add_argument("--flavor", help="check this flavor instead of the lab's")
    p.epilog = sp.description  # what to set and what a run costs, where a new user looks first
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p = hf_add("prepare", cmd_prepare, "start the one-time job that fills the bucket with the "
                                       "prepared data (a CPU flavor)")
    p.add_argument("--source", help="hub (default: the lab's data source) or synthetic")
    p.add_argument("--flavor", default=PREPARE_FLAVOR, help=f"default {PREPARE_FLAVOR}")
    p.add_argument("--timeout", default=PREPARE_TIMEOUT, help=f"default {PREPARE_TIMEOUT}")
    p.add_argument("--wait", action="store_true", help="stream its log until it ends")
    p = hf_add("jobs", cmd_jobs, "this lab's jobs in flight (--all: every one)")
    p.add_argument("--all", action="store_true")
    p = hf_add("logs", cmd_logs, "the log of an experiment's job, from Hugging Face")
    p.add_argument("name", nargs="?")
    p.add_argument("--job", help="a job id instead of an experiment name")
    p.add_argument("-f", "--follow", action="store_true")

