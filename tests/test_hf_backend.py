"""The Hugging Face Jobs backend through the local loop, against a stand-in Jobs service.

The real huggingface_hub client talks HTTP to tests/hf_server.py on
127.0.0.1; the lab is a real one (`autolab init`, git worktrees, ledger).
The jobs here are scripted (the service plays the job's stages and log
lines); tests/test_hf_e2e.py runs the shipped entry point for real.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import stat
import time
from pathlib import Path

import pytest
import yaml

from controller.backends.hf import HfBackend, HfBackendError
from controller.cli.lab import init_lab
from controller.core.spec import API_VERSION
from controller.local import LocalLab
from hf_server import FakeJobsServer, Script, genuine_result, harness_result, shipped_files, \
    signed_line

TOKEN = "hf_TESTtokenNeverToBeSeen0123456789"
MASTER_VAL = 2.5


@pytest.fixture()
def server(tmp_path, monkeypatch):
    srv = FakeJobsServer(TOKEN, work_dir=tmp_path).start()
    srv.add_bucket("alice/autolab-cache", tmp_path / "bucket")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("AUTOLAB_GPUS", "0,1")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")  # Trackio is tested on its own
    yield srv
    srv.stop()


def make_lab(root: Path, hf: dict | None = None, data: str = "synthetic") -> LocalLab:
    init_lab(root, profile="tiny", data=data, budget=2)
    doc = yaml.safe_load((root / "lab.yaml").read_text())
    doc["spec"]["backend"] = "hf"
    doc["spec"]["hf"] = {"namespace": "alice", "bucket": "autolab-cache", "flavor": "l4x1",
                         "timeout": "20m", **(hf or {})}
    (root / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    lab = LocalLab(root)
    lab.repo.set_master_metric(MASTER_VAL)  # the baseline is measured in test_hf_e2e.py
    return lab


def apply(lab: LocalLab, name: str, hf: dict | None = None, lr: str = "0.03") -> str:
    old = (lab.root / "bench" / "train.py").read_text()
    new = old.replace("MATRIX_LR = 0.02", f"MATRIX_LR = {lr}")
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        "a/bench/train.py", "b/bench/train.py"))
    spec = {"hypothesis": "A higher matrix learning rate trains faster.", "campaign": "lr-sweep",
            "parent": lab.repo.master().hash[:8], "diff": diff, "backend": "hf"}
    if hf:
        spec["hf"] = hf
    lab.apply_file({"apiVersion": API_VERSION, "kind": "Experiment", "metadata": {"name": name},
                    "spec": spec}, "test")
    return new


def phase(lab: LocalLab, name: str) -> str | None:
    return (lab.read_record(name).get("status") or {}).get("phase")


def step_until(lab: LocalLab, done, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        lab.step()
        if done():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out; statuses: "
                         f"{ {n: lab.read_record(n).get('status') for n in lab.names()} }")


def ledger_row(lab: LocalLab, name: str) -> dict:
    rows = [r for r in lab.ledger.rows() if r["experiment_id"] == name]
    assert len(rows) == 1, rows
    return rows[0]


def test_experiment_becomes_one_job_with_its_flavor_labels_read_only_bucket_and_key(server,
                                                                                    tmp_path):
    lab = make_lab(tmp_path / "lab")
    candidate = apply(lab, "lr-up", hf={"flavor": "h200", "timeout": "45m"})
    server.script_next(Script(stage="COMPLETED", running_polls=2,
                              logs=lambda job: genuine_result(job, 2.25)))
    seen = []
    step_until(lab, lambda: seen.append(phase(lab, "lr-up")) or phase(lab, "lr-up") == "Succeeded")
    assert "Queued" in seen and "Running" in seen  # SCHEDULING, then RUNNING, then the result

    [job] = server.created()
    body = job.spec
    assert body["flavor"] == "h200"  # the experiment's override beats the lab's l4x1
    assert body["timeoutSeconds"] == 45 * 60
    assert body["labels"] == {"name": "exp-lr-up-1", "autolab-run": "exp-lr-up-1",
                              "autolab-experiment": "lr-up", "autolab-campaign": "lr-sweep",
                              "autolab-lab": "default", "autolab-role": "run",
                              "autolab-lab-id": lab.repo.master_doc()["history"][0]["commit"][:12]}
    assert body["volumes"] == [{"type": "bucket", "source": "alice/autolab-cache",
                                "mountPath": "/autolab-data", "readOnly": True}]
    # No HF token for candidate code; the synthetic validation seed is the lab's, the same for every job.
    assert set(body["secrets"]) == {"AUTOLAB_RESULT_KEY", "AUTOLAB_SYNTHETIC_SEED"}
    assert body["secrets"]["AUTOLAB_SYNTHETIC_SEED"] == (lab.root / ".autolab" / "synthetic.seed").read_text().strip()
    assert body["secrets"]["AUTOLAB_SYNTHETIC_SEED"] not in json.dumps(body["environment"] if "environment" in body else {})
    assert server.hits("POST", "/api/jobs/alice") and job.namespace == "alice"
    files = shipped_files(job)
    assert files["bench/train.py"].decode() == candidate
    assert files["bench/prepare.py"] == (lab.root / "bench" / "prepare.py").read_bytes()  # pinned = lab's first
    assert {"bench/run.py", "bench/evaluate.py", "bench/hf_entry.py"} <= set(files)
    assert body["command"][:2] == ["python3", "-c"] and "--with" in body["command"]
    assert TOKEN not in json.dumps(body)

    st = lab.read_record("lr-up")["status"]
    assert (st["outcome"], st["metrics"]["val_bpb"]) == ("Promoted", 2.25)
    assert lab.repo.master().experiment == "lr-up"
    row = ledger_row(lab, "lr-up")
    assert (row["status"], row["val_bpb"], row["job_id"], row["backend"], row["worker_id"]) == \
        ("succeeded", "2.25", job.id, "hf", "hf:alice:h200")
    key = lab.root / ".autolab" / "runs" / "exp-lr-up-1" / "result.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_job_that_ends_in_error_fails_the_experiment_with_the_jobs_message(server, tmp_path):
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").result_grace_seconds = 0
    apply(lab, "oom")
    server.script_next(Script(stage="ERROR", message="Job failed: CUDA out of memory",
                              logs=["Traceback ...", "torch.OutOfMemoryError"]))
    step_until(lab, lambda: phase(lab, "oom") == "Failed")
    st = lab.read_record("oom")["status"]
    assert st["reason"] == "InfrastructureError"
    assert "CUDA out of memory" in st["message"]
    assert ledger_row(lab, "oom")["status"] == "error"
    assert lab.repo.master().experiment is None


def test_deleting_the_experiment_cancels_its_job_and_records_it(server, tmp_path):
    lab = make_lab(tmp_path / "lab")
    apply(lab, "long")
    server.script_next(Script(hold=True))
    step_until(lab, lambda: phase(lab, "long") == "Running")
    [job] = server.created()
    lab.delete("long")
    assert len(server.hits("POST", f"/api/jobs/alice/{job.id}/cancel")) == 1
    assert job.stage == "CANCELED"
    assert "long" not in lab.names()  # finalized once recorded
    row = ledger_row(lab, "long")
    assert row["status"] == "cancelled" and row["job_id"] == job.id
    lab.step()
    assert len(server.created()) == 1


def test_restarted_controller_adopts_its_job_instead_of_launching_another(server, tmp_path):
    root = tmp_path / "lab"
    lab = make_lab(root)
    apply(lab, "restart")
    server.script_next(Script(stage="COMPLETED", running_polls=3,
                              logs=lambda job: genuine_result(job, 2.4)))
    lab.step()
    assert len(server.created()) == 1
    # A crash after the job was created but before its id was written down: only the labels
    # (and the key, kept before submitting) are left.
    (root / ".autolab" / "runs" / "exp-restart-1" / "hf.json").unlink()
    again = LocalLab(root)
    assert again.backend_for("hf") is not lab.backend_for("hf")
    step_until(again, lambda: phase(again, "restart") == "Succeeded")
    assert len(server.hits("POST", "/api/jobs/alice")) == 1
    label_lookups = [r for r in server.hits("GET", "/api/jobs/alice")
                     if ("label", "autolab-run=exp-restart-1") in r["query"]]
    assert label_lookups
    assert again.read_record("restart")["status"]["metrics"]["val_bpb"] == 2.4


def own_sha1(job) -> str:
    """What a forging candidate knows: the sha1 of its own source."""
    return hashlib.sha1(shipped_files(job)["bench/train.py"]).hexdigest()


FORGERIES = {
    # the harness's plain marker line: anyone can print it
    "unsigned": lambda job: "AUTOLAB_RESULT " + json.dumps(harness_result(0.001, own_sha1(job))),
    # signed with a key the candidate made up
    "wrong-key": lambda job: signed_line(job, harness_result(0.001, own_sha1(job)),
                                         key="f" * 64),
    # signed with this job's key but for another run (a replayed line)
    "other-run": lambda job: signed_line(job, harness_result(0.001, own_sha1(job)),
                                         run="exp-other-1"),
    # signed for this run, but measuring a program that is not the candidate shipped
    "other-candidate": lambda job: signed_line(job, harness_result(0.001, "0" * 40)),
}


@pytest.mark.parametrize("forgery", sorted(FORGERIES))
def test_result_lines_the_candidate_could_print_are_not_believed(server, tmp_path, forgery):
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").result_grace_seconds = 0
    apply(lab, "forger")
    server.script_next(Script(stage="COMPLETED", logs=lambda job: [FORGERIES[forgery](job)]))
    step_until(lab, lambda: phase(lab, "forger") == "Failed")
    st = lab.read_record("forger")["status"]
    assert "no authentic result" in st["message"]
    assert st.get("metrics") is None and lab.repo.master().val_bpb == MASTER_VAL
    assert ledger_row(lab, "forger")["val_bpb"] == ""


def test_token_in_a_job_log_is_blanked_in_every_file_we_write(server, tmp_path):
    lab = make_lab(tmp_path / "lab")
    apply(lab, "noisy")
    server.script_next(Script(stage="COMPLETED", logs=lambda job: [
        f"debug: HF_TOKEN={TOKEN}", *genuine_result(job, 2.0)]))
    step_until(lab, lambda: phase(lab, "noisy") == "Succeeded")
    log = (lab.root / ".autolab" / "runs" / "exp-noisy-1" / "log.txt").read_text()
    assert "HF_TOKEN=[redacted]" in log
    key = (lab.root / ".autolab" / "runs" / "exp-noisy-1" / "result.key").read_text()
    for path in lab.root.rglob("*"):
        if path.is_file() and ".git" not in path.parts:
            data = path.read_bytes()
            assert TOKEN.encode() not in data, path
            if path.name != "result.key":
                assert key.encode() not in data, path


def test_missing_token_stops_the_loop_saying_what_to_set(server, tmp_path, monkeypatch):
    lab = make_lab(tmp_path / "lab")
    apply(lab, "tokenless")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HfBackendError, match="HF_TOKEN or run `hf auth login`"):
        step_until(lab, lambda: False, timeout=5)
    assert not server.created()


def test_a_data_directory_on_this_machine_is_refused_before_any_job(server, tmp_path):
    (tmp_path / "texts").mkdir()
    lab = make_lab(tmp_path / "lab", data=f"dir:{tmp_path / 'texts'}")
    apply(lab, "local-data")
    with pytest.raises(HfBackendError, match="cannot read it"):
        step_until(lab, lambda: False, timeout=5)
    assert not server.created()


def test_backend_is_built_from_the_lab_by_the_local_loop(server, tmp_path):
    lab = make_lab(tmp_path / "lab", hf={"bucket": "shared/cache"})
    backend = lab.backend_for("hf")
    assert isinstance(backend, HfBackend)
    assert backend.api.endpoint == server.url
    s = backend.settings({"flavor": "a100-large"})
    assert (s.flavor, s.timeout, s.namespace) == ("a100-large", "20m", "alice")
    assert backend.bucket_id(s, "alice") == "shared/cache"


async def test_in_a_cluster_the_token_comes_from_the_secret_the_lab_names(kmock):
    import asyncio
    import base64

    import kubernetes

    from controller.backends.hf import token_from_secret
    config = kubernetes.client.Configuration()
    config.host = str(kmock.url).rstrip("/")
    core = kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(config))
    for name, data in (("hf-token", {"HF_TOKEN": base64.b64encode(TOKEN.encode()).decode()}),
                       ("wrong-key", {"token": base64.b64encode(b"x").decode()})):
        await asyncio.to_thread(core.create_namespaced_secret, "autolab", {
            "apiVersion": "v1", "kind": "Secret", "data": data,
            "metadata": {"name": name, "namespace": "autolab"}})
    assert await asyncio.to_thread(token_from_secret, "hf-token", "autolab", core) == TOKEN
    with pytest.raises(HfBackendError, match="has no key HF_TOKEN; create it with `kubectl -n "
                                             "autolab create secret generic wrong-key"):
        await asyncio.to_thread(token_from_secret, "wrong-key", "autolab", core)


def test_jobs_ship_the_pinned_harness_not_the_labs_editable_bench(server, tmp_path):
    lab = make_lab(tmp_path / "lab")
    original = (lab.root / "bench" / "prepare.py").read_bytes()
    (lab.root / "bench" / "prepare.py").write_bytes(original + b"\nevaluate_bpb = lambda *a, **k: 0.0\n")
    files = lab.backend_for("hf").bench_files("print('candidate')\n")
    assert files["bench/prepare.py"] == original
    assert files["bench/train.py"] == b"print('candidate')\n"
    assert {"bench/run.py", "bench/evaluate.py", "bench/sandbox.py", "bench/hf_entry.py"} <= set(files)


@pytest.mark.parametrize("local_gpus", ["", "0"], ids=["no-gpu", "one-gpu"])
def test_an_hf_lab_runs_gpu_slots_jobs_at_once_whatever_gpus_this_machine_has(
        server, tmp_path, monkeypatch, local_gpus):
    """The jobs at once follow the Lab's capacity.gpuSlots, not this machine's GPUs."""
    monkeypatch.setenv("AUTOLAB_GPUS", local_gpus)
    lab = make_lab(tmp_path / "lab")
    doc = yaml.safe_load((lab.root / "lab.yaml").read_text())
    doc["spec"]["capacity"] = {"gpuSlots": 3}
    (lab.root / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    lab = LocalLab(lab.root)
    for i, lr in enumerate(("0.03", "0.04", "0.05", "0.06")):
        apply(lab, f"lr-{i}", lr=lr)
        server.script_next(Script(hold=True))
    lab.step()
    assert len(server.created()) == 3, "three jobs at once: gpuSlots"
    waiting = [lab.read_record(f"lr-{i}")["status"] for i in range(4)
               if not lab.read_record(f"lr-{i}")["status"].get("job")]
    assert len(waiting) == 1 and any(c["reason"] == "WaitingForSlot"
                                     for c in waiting[0]["conditions"])
