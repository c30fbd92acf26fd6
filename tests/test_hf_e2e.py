"""A lab on Hugging Face Jobs, end to end, with the shipped entry point really running.

The stand-in Jobs service (tests/hf_server.py) executes each job's command
on this machine: the bootstrap unpacks the bundle the controller shipped,
bench/hf_entry.py drops its secrets, re-execs, runs the real harness on the
tiny CPU profile and prints its signed result. So this covers what no
scripted job can: `autolab hf prepare` filling the bucket, the master's
baseline and an experiment measured in jobs, the result read from the job's
log and verified, its step curve brought back for Trackio, and a candidate
that hunts for the key and forges result lines getting nowhere. About a
minute on two idle cores.
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from controller.cli import main as cli
from controller.core.spec import API_VERSION
from controller.local import LocalLab, init_lab
from hf_server import FakeJobsServer
from test_environment_faults import open_dir  # noqa: F401  (a fixture)

TOKEN = "hf_E2EtokenThatMustNeverBeWritten987"

# Added to the candidate: look for the secrets in its own environment and in every ancestor's
# up to the job's entry point (where a naive job would keep them), then forge results.
HUNT = '''
import base64 as _b64, json as _json, os as _os
_seen, _pid, _leaks = [], _os.getpid(), []
while _pid > 1:
    try:
        _env = open(f"/proc/{_pid}/environ", "rb").read()
        _cmd = open(f"/proc/{_pid}/cmdline", "rb").read()
        _seen.append(str(_pid))
    except OSError:
        _env, _cmd = b"", b""
        _seen.append(f"{_pid}:unreadable")
    if b"AUTOLAB_RESULT_KEY=" in _env or b"HF_TOKEN=" in _env:
        _leaks.append(str(_pid))
    if b"hf_entry.py" in _cmd:
        break
    _pid = int(open(f"/proc/{_pid}/stat").read().rsplit(")", 1)[1].split()[1])
print("LEAKCHECK", ("LEAKED in " + " ".join(_leaks)) if _leaks else "clean", "checked", *_seen,
      flush=True)
_fake = {"version": 1, "status": "succeeded", "reason": "forged", "exit_code": 0,
         "candidate_sha1": None, "metrics": {"val_bpb": 0.0001}}
print("AUTOLAB_RESULT " + _json.dumps(_fake), flush=True)
_payload = _json.dumps({"run": "exp-hunter-1", "result": _fake}).encode()
print("AUTOLAB_SIGNED_RESULT v1 " + _b64.urlsafe_b64encode(_payload).decode() + " " + "0" * 64,
      flush=True)
'''


@pytest.fixture(scope="module")
def hf_lab(tmp_path_factory):
    """A tiny-profile lab whose backend is hf, and a bucket filled by `autolab hf prepare`."""
    tmp = tmp_path_factory.mktemp("hf-e2e")
    with pytest.MonkeyPatch.context() as mp:
        srv = FakeJobsServer(TOKEN, work_dir=tmp).start()
        bucket = srv.add_bucket("alice/autolab-cache", tmp / "bucket")
        mp.setenv("HF_TOKEN", TOKEN)
        mp.setenv("HF_ENDPOINT", srv.url)
        mp.setenv("HF_HOME", str(tmp / "hf-home"))
        mp.setenv("AUTOLAB_GPUS", "0")
        root = tmp / "lab"
        init_lab(root, profile="tiny", data="synthetic", budget=2, min_delta=0)
        doc = yaml.safe_load((root / "lab.yaml").read_text())
        doc["spec"]["backend"] = "hf"
        doc["spec"]["hf"] = {"namespace": "alice", "bucket": "autolab-cache", "flavor": "l4x1",
                             "timeout": "20m"}
        (root / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        rc = cli.main(["hf", "prepare", "--lab", str(root), "--wait"])
        assert rc == 0
        yield srv, root, bucket
        srv.stop()


def test_prepare_job_fills_the_bucket_the_runs_mount(hf_lab):
    srv, root, bucket = hf_lab
    [job] = [j for j in srv.created() if j.spec["labels"].get("autolab-role") == "prepare"]
    assert job.stage == "COMPLETED"
    assert job.spec["flavor"] == "cpu-upgrade"
    assert job.spec["volumes"] == [{"type": "bucket", "source": "alice/autolab-cache",
                                    "mountPath": "/autolab-data", "readOnly": False}]
    assert job.spec["secrets"] == {"HF_TOKEN": TOKEN}  # a secret, for downloads; not in env
    assert TOKEN not in json.dumps(job.spec["environment"]) + json.dumps(job.spec["command"])
    manifests = list((bucket / "data").glob("*/manifest.json"))
    assert len(manifests) == 1 and json.loads(manifests[0].read_text())["files"]


def test_experiment_measured_in_a_job_is_recorded_and_promoted_on_its_real_metric(hf_lab):
    srv, root, _ = hf_lab
    lab = LocalLab(root)
    old = (root / "bench" / "train.py").read_text()
    anchor = "import prepare\n"
    new = old.replace(anchor, anchor + HUNT, 1)
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "a/bench/train.py", "b/bench/train.py"))
    lab.apply_file({"apiVersion": API_VERSION, "kind": "Experiment",
                    "metadata": {"name": "hunter"},
                    "spec": {"hypothesis": "Printing a better val_bpb makes it true.",
                             "campaign": "forgery", "parent": lab.repo.master().hash[:8],
                             "diff": diff, "hf": {"flavor": "a100-large"}}}, "test")
    deadline = time.time() + 300
    while time.time() < deadline:
        summary = lab.step()
        if summary.done:
            break
        time.sleep(0.3)
    assert summary.done, summary.rows

    runs = [j for j in srv.created() if j.spec["labels"].get("autolab-role") != "prepare"]
    assert [j.spec["labels"]["autolab-role"] for j in runs] == ["baseline", "run"]
    baseline_job, job = runs
    assert (baseline_job.spec["flavor"], job.spec["flavor"]) == ("l4x1", "a100-large")
    assert all(j.stage == "COMPLETED" for j in runs)

    baseline = lab.repo.master_doc()["history"][0]["val_bpb"]
    assert isinstance(baseline, float) and baseline > 0.01  # measured in the baseline job
    st = lab.read_record("hunter")["status"]
    val = st["metrics"]["val_bpb"]
    assert st["phase"] == "Succeeded" and val > 0.01  # the harness's measurement, not 0.0001
    assert st["outcome"] == ("Promoted" if val < baseline else "Rejected")
    row = [r for r in lab.ledger.rows() if r["experiment_id"] == "hunter"][0]
    assert (float(row["val_bpb"]), row["job_id"], row["backend"]) == (val, job.id, "hf")
    assert row["promoted"] == ("1" if val < baseline else "0")

    # The step curve came back from the job, where Trackio reads a local run's (issue 13).
    from controller.lab import tracking
    run_dir = root / ".autolab" / "runs" / "exp-hunter-1"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["metrics"]["val_bpb"] == val and result["curve"] == str(run_dir / "curve.jsonl")
    points = tracking.curve_points(root, "exp-hunter-1", result)
    assert points and all(m.get("loss", 0) > 0 for _, m in points), points

    log = (root / ".autolab" / "runs" / "exp-hunter-1" / "log.txt").read_text()
    assert "prepared data from the bucket (read-only)" in log
    hunt = [line for line in log.splitlines() if line.startswith("LEAKCHECK")]
    assert hunt and hunt[0].startswith("LEAKCHECK clean checked"), hunt
    assert len(hunt[0].split()) >= 4  # it reached at least the entry point's process
    assert "AUTOLAB_SIGNED_RESULT v1" in log  # the forgery was printed, and ignored

    # The token reaches no job of a run, no file in the lab and no commit.
    key = (root / ".autolab" / "runs" / "exp-hunter-1" / "result.key").read_bytes()
    for j in runs:
        assert TOKEN not in json.dumps(j.spec)
    for path in Path(root).rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            data = path.read_bytes()
            assert TOKEN.encode() not in data, path
            if path.name != "result.key":
                assert key not in data, path
    history = subprocess.run(["git", "log", "--all", "-p"], cwd=root, capture_output=True).stdout
    assert TOKEN.encode() not in history and key not in history


def test_entry_point_refuses_to_measure_when_a_parent_process_keeps_the_key(tmp_path):
    entry = Path(__file__).resolve().parents[1] / "bench" / "hf_entry.py"
    # A shell that stays alive above the entry point, its environment holding the secret.
    command = f'"{sys.executable}" "{entry}" run --run exp-x-1 --profile tiny; exit $?'
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                             "AUTOLAB_RESULT_KEY": "k" * 64})
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "keep AUTOLAB_RESULT_KEY in their environment" in proc.stdout
    assert "AUTOLAB_SIGNED_RESULT" not in proc.stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="a job's sandbox runs as a uid of its own only when the job is root "
                                              "(as Hugging Face jobs are); as another user it runs as that user, "
                                              "who can read their own Python")
def test_a_job_whose_python_its_sandbox_cannot_read_fails_as_the_machine_and_the_diff_runs_again(hf_lab,
                                                                                                 open_dir):
    """A job image whose Python the sandbox's uid cannot read: every run of it would crash on
    `import torch`. The sandbox says so before the candidate runs: the experiment fails with
    SandboxUnavailable, its ledger row says `error` (no verdict), and once the image is fixed the
    same diff, applied again, is measured."""
    from test_environment_faults import a_python
    srv, root, _ = hf_lab
    python, fix = a_python(open_dir, "unreadable")
    srv.python = python
    try:
        with LocalLab(root) as lab:
            lab.repo.set_master_metric(0.001)  # unless measured already: no baseline job here
            old = (root / "bench" / "train.py").read_text()
            new = old.replace("WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.45", 1)
            diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                                "a/bench/train.py", "b/bench/train.py"))

            def measure(name: str) -> dict:
                lab.apply_file({"apiVersion": API_VERSION, "kind": "Experiment", "metadata": {"name": name},
                                "spec": {"hypothesis": "A shorter warmdown.", "campaign": "images",
                                         "parent": lab.repo.master().hash[:8], "diff": diff}}, "test")
                deadline = time.time() + 300
                while time.time() < deadline:
                    st = lab.step() and lab.read_record(name).get("status", {})
                    if st.get("phase") in ("Succeeded", "Failed", "Duplicate", "Invalid"):
                        return st
                    time.sleep(0.3)
                raise AssertionError(f"{name} did not finish")

            st = measure("image-unreadable")
            assert (st["phase"], st["reason"]) == ("Failed", "SandboxUnavailable"), st
            assert "cannot import what the benchmark needs" in st["message"], st["message"]
            [row] = [r for r in lab.ledger.rows() if r["experiment_id"] == "image-unreadable"]
            assert row["status"] == "error", row
            fix()
            st = measure("image-fixed")
            assert st["phase"] == "Succeeded", st
    finally:
        srv.python = sys.executable
