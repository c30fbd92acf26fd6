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
from controller.core.reconcile import LOST_RETRIES
from controller.core.spec import API_VERSION
from controller.local import LocalLab, init_lab
from hf_server import FakeJobsServer, Script, genuine_result, harness_result, shipped_files, \
    signed_curve, signed_line

REPO = Path(__file__).resolve().parents[1]
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
    fast_watch(monkeypatch)
    yield srv
    srv.stop()


def fast_watch(monkeypatch) -> None:
    """The backend's waits scaled down for a loop that steps every 50 ms (real time)."""
    monkeypatch.setattr(HfBackend, "poll_min_seconds", 0.05)
    monkeypatch.setattr(HfBackend, "poll_max_seconds", 0.2)
    monkeypatch.setattr(HfBackend, "log_retry_seconds", 0.2)


def make_lab(root: Path, hf: dict | None = None, data: str = "synthetic") -> LocalLab:
    init_lab(root, profile="tiny", data=data, budget=2, min_delta=0)  # one run decides
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


def runs_of(lab: LocalLab, name: str) -> list[tuple[str, str, str]]:
    """(run_id, status, val_bpb) of an experiment's ledger rows, in the order written."""
    return [(r["run_id"], r["status"], r["val_bpb"]) for r in lab.ledger.rows()
            if r["experiment_id"] == name]


def lost_every_try(run: str, last: str) -> list[tuple[str, str, str]]:
    """The rows of a first run lost on every try: each try but the last `lost`, the last one
    the experiment's verdict row (`last`), none with a value."""
    names = [run] + [f"{run}-t{k}" for k in range(2, LOST_RETRIES + 2)]
    return [(n, "lost", "") for n in names[:-1]] + [(names[-1], last, "")]


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
    # The run's name is in the environment, not on the command line, which every uid in the
    # job's container can read (a confirm run's name would tell the candidate its place).
    assert body["environment"]["AUTOLAB_RUN"] == "exp-lr-up-1"
    assert not any("exp-lr-up" in part for part in body["command"])
    assert TOKEN not in json.dumps(body)

    st = lab.read_record("lr-up")["status"]
    assert (st["outcome"], st["metrics"]["val_bpb"]) == ("Promoted", 2.25)
    assert lab.repo.master().experiment == "lr-up"
    row = ledger_row(lab, "lr-up")
    assert (row["status"], row["val_bpb"], row["job_id"], row["backend"], row["worker_id"]) == \
        ("succeeded", "2.25", job.id, "hf", "hf:alice:h200")
    key = lab.root / ".autolab" / "runs" / "exp-lr-up-1" / "result.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_job_that_ends_in_error_every_time_fails_the_experiment_with_the_jobs_message(server,
                                                                                   tmp_path):
    """A job in ERROR without a result is the machine's, not the candidate's: each try is
    recorded lost and run again; after the bound (LOST_RETRIES + 1 tries) the experiment ends
    RunsLost with the job's own words, not held against the candidate."""
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").result_grace_seconds = 0
    apply(lab, "oom")
    for _ in range(LOST_RETRIES + 1):
        server.script_next(Script(stage="ERROR", message="Job failed: CUDA out of memory",
                                  logs=["Traceback ...", "torch.OutOfMemoryError"]))
    step_until(lab, lambda: phase(lab, "oom") == "Failed")
    st = lab.read_record("oom")["status"]
    assert st["reason"] == "RunsLost"
    assert "CUDA out of memory" in st["message"]
    assert [x["reason"] for x in st["lostRuns"] if "CUDA out of memory" in x["reason"]] \
        == [x["reason"] for x in st["lostRuns"]] and len(st["lostRuns"]) == LOST_RETRIES + 1
    assert runs_of(lab, "oom") == lost_every_try("exp-oom-1", "error")
    assert len(server.created()) == LOST_RETRIES + 1
    assert lab.repo.master().experiment is None


def test_a_job_that_ends_in_error_without_a_result_runs_again_and_its_retry_decides(server,
                                                                                   tmp_path):
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").result_grace_seconds = 0
    apply(lab, "preempted")
    server.script_next(Script(stage="ERROR", message="Job failed: node preempted"))
    server.script_next(Script(stage="COMPLETED", logs=lambda job: genuine_result(job, 2.25)))
    step_until(lab, lambda: phase(lab, "preempted") == "Succeeded")
    st = lab.read_record("preempted")["status"]
    assert [x["run"] for x in st["lostRuns"]] == ["exp-preempted-1"]
    assert "node preempted" in st["lostRuns"][0]["reason"]
    assert (st["outcome"], st["metrics"]["val_bpb"], st["run"]) == \
        ("Promoted", 2.25, "exp-preempted-1-t2")
    assert runs_of(lab, "preempted") == [("exp-preempted-1", "lost", ""),
                                         ("exp-preempted-1-t2", "succeeded", "2.25")]
    first, retry = server.created()
    assert (first.spec["labels"]["autolab-run"], retry.spec["labels"]["autolab-run"]) == \
        ("exp-preempted-1", "exp-preempted-1-t2")


def test_a_job_that_vanishes_from_the_service_is_lost_and_run_again(server, tmp_path):
    """Seen running once (its id known), then gone: lost, never adopted again under its name."""
    lab = make_lab(tmp_path / "lab")
    apply(lab, "vanish")
    server.script_next(Script(hold=True))
    server.script_next(Script(stage="COMPLETED", logs=lambda job: genuine_result(job, 2.3)))
    step_until(lab, lambda: phase(lab, "vanish") == "Running")
    [job] = server.created()
    del server.jobs[job.id]  # the service forgot it (a deleted job, a lost record)
    step_until(lab, lambda: phase(lab, "vanish") == "Succeeded")
    st = lab.read_record("vanish")["status"]
    assert [(x["run"], x["state"]) for x in st["lostRuns"]] == [("exp-vanish-1", "lost")]
    assert job.id in st["lostRuns"][0]["reason"]
    assert st["metrics"]["val_bpb"] == 2.3
    assert runs_of(lab, "vanish") == [("exp-vanish-1", "lost", ""),
                                      ("exp-vanish-1-t2", "succeeded", "2.3")]
    assert [j.spec["labels"]["autolab-run"] for j in server.created()] == ["exp-vanish-1-t2"]


def test_a_master_run_and_a_candidate_run_lost_mid_decision_run_again_and_the_pairs_stay(
        server, tmp_path):
    """Issue 45 on Hugging Face Jobs: a paired decision (minDelta auto). At place 2 both runs,
    the master's and the candidate's (in the order its coin drew), end once in ERROR with no
    result (a preempted node). Each runs again at place 2 under a name of its own; the decision
    ends promoted on the same pairs, and the ledger has each lost try once, as lost."""
    import re

    lab = make_lab(tmp_path / "lab")
    doc = yaml.safe_load((lab.root / "lab.yaml").read_text())
    doc["spec"]["promotion"] = {"minDelta": "auto"}
    (lab.root / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    lab = LocalLab(lab.root)

    def measured(job) -> list[str]:  # the master 0.2 worse than the candidate at every place
        run = job.spec["labels"]["autolab-run"]
        place = re.search(r"-[mp](\d+)", run)
        base = 2.5 if re.search(r"-m\d+", run) else 2.3
        return genuine_result(job, base + 0.001 * (int(place.group(1)) if place else 1))

    ok = Script(stage="COMPLETED", logs=measured)
    lost = Script(stage="ERROR", message="the node was preempted")
    for script in (ok, lost, ok, lost, ok, ok, ok):
        server.script_next(script)
    apply(lab, "paired")
    step_until(lab, lambda: phase(lab, "paired") == "Succeeded", timeout=120)
    st = lab.read_record("paired")["status"]
    assert st["outcome"] == "Promoted", st["message"]
    assert st["pairs"]["candidate"] == pytest.approx([2.301, 2.302, 2.303])
    assert st["pairs"]["master"] == pytest.approx([MASTER_VAL, 2.502, 2.503])
    assert sorted((x["program"], x["place"], x["state"]) for x in st["lostRuns"]) == [
        ("candidate", 2, "error"), ("master", 2, "error")]
    rows = runs_of(lab, "paired")
    assert len({r for r, _, _ in rows}) == len(rows)  # nothing counted twice
    assert sorted((r, status) for r, status, _ in rows if status == "lost") == [
        ("exp-paired-1-m2", "lost"), ("exp-paired-1-p2", "lost")]
    made = [j.spec["labels"]["autolab-run"] for j in server.created()]
    assert {"exp-paired-1-m2-t2", "exp-paired-1-p2-t2"} <= set(made) and len(made) == 7, made


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
    """A forged line is never a result: each try is lost (no authentic result, and the message
    names the missing signed line), run again, and a forger on every try ends RunsLost after the
    bound, never promoted and never measured."""
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").result_grace_seconds = 0
    apply(lab, "forger")
    for _ in range(LOST_RETRIES + 1):
        server.script_next(Script(stage="COMPLETED", logs=lambda job: [FORGERIES[forgery](job)]))
    step_until(lab, lambda: phase(lab, "forger") == "Failed")
    st = lab.read_record("forger")["status"]
    assert st["reason"] == "RunsLost"
    assert "no authentic result" in st["message"] and "signed with this run's key" in st["message"]
    assert len(st["lostRuns"]) == LOST_RETRIES + 1
    for lost in st["lostRuns"]:
        assert "no authentic result" in lost["reason"], lost
        assert "signed with this run's key" in lost["reason"], lost
    assert st.get("metrics") is None and lab.repo.master().val_bpb == MASTER_VAL
    assert lab.repo.master().experiment is None
    assert runs_of(lab, "forger") == lost_every_try("exp-forger-1", "error")
    assert len(server.created()) == LOST_RETRIES + 1


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


# --- issue 13: the backend against a service that behaves like the real one ---------------------

class FakeClock:
    """Simulated seconds, shared by the backend and the stand-in service."""

    def __init__(self) -> None:
        self.t = time.time()

    def __call__(self) -> float:
        return self.t


def curve(n: int, start: int = 0) -> list[dict]:
    return [{"step": s, "loss": 5.0 - s / 1000, "tokens_per_sec": 1000.0 + s, "time": 100.0 + s}
            for s in range(start, start + n)]


def test_an_hf_run_brings_its_step_curve_back_where_trackio_reads_it(server, tmp_path):
    from controller.lab import tracking
    lab = make_lab(tmp_path / "lab")
    apply(lab, "curvy")
    points = curve(120)
    server.script_next(Script(stage="COMPLETED", logs=lambda job: [
        # The candidate prints into the same log: forged, broken and oversized curve lines.
        *signed_curve(job, curve(7, start=900), key="f" * 64),
        "AUTOLAB_SIGNED_CURVE curve-v1 not-base64!! " + "0" * 64,
        "AUTOLAB_SIGNED_CURVE curve-v1 " + "A" * 200_000 + " " + "0" * 64,
        *["AUTOLAB_SIGNED_CURVE junk"] * 3000,
        # The entry point's, after the candidate is dead.
        *signed_curve(job, points), *genuine_result(job, 2.3)]))
    step_until(lab, lambda: phase(lab, "curvy") == "Succeeded")
    run_dir = lab.root / ".autolab" / "runs" / "exp-curvy-1"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["metrics"]["val_bpb"] == 2.3 and result["curve"] == str(run_dir / "curve.jsonl")
    got = tracking.curve_points(lab.root, "exp-curvy-1", result)
    assert [s for s, _ in got] == list(range(120))
    assert got[5][1]["loss"] == pytest.approx(4.995) and got[5][1]["tokens_per_sec"] == 1005.0
    log = (run_dir / "log.txt").read_text()
    assert len(log) < 2_000_000  # the 200 kB line is cut in log.txt


def test_the_controller_keeps_only_checked_numbers_of_a_curve_however_it_was_signed(tmp_path):
    """Even signed, a curve is informational: every number is checked, its size is bounded."""
    from controller.backends.hf_wire import MAX_CURVE_POINTS, verify_signed_curve
    from hf_server import _entry_module
    entry, key = _entry_module(), b"k" * 64
    bad = [{"step": 1, "loss": float("nan")}, {"step": True, "loss": 1.0},
           {"step": -1, "loss": 1.0}, {"step": 2, "loss": "1.0"}, {"step": 2.5, "loss": 1.0},
           {"step": 3, "loss": float("inf"), "tokens_per_sec": 9.0}, "not a point",
           {"step": 4, "loss": 1.5, "extra": "x" * 100}]
    lines = entry.sign_curve(key, "exp-x-1", bad)
    assert verify_signed_curve(lines, key, "exp-x-1") == [{"step": 3, "tokens_per_sec": 9.0},
                                                          {"step": 4, "loss": 1.5}]
    assert verify_signed_curve(lines, key, "exp-other-1") == []  # another run's curve
    assert verify_signed_curve(lines, b"x" * 64, "exp-x-1") == []  # another key
    many = entry.sign_curve(key, "exp-x-1", curve(3 * MAX_CURVE_POINTS))
    assert len(verify_signed_curve(many, key, "exp-x-1")) == MAX_CURVE_POINTS


def test_a_stalled_log_stream_is_a_lost_try_run_again_and_never_holds_up_the_loop(server,
                                                                                 tmp_path):
    lab = make_lab(tmp_path / "lab")
    backend = lab.backend_for("hf")
    backend.log_stall_seconds, backend.result_grace_seconds = 0.5, 1.0
    apply(lab, "stalled")
    server.script_next(Script(stage="COMPLETED", running_polls=2, stall_logs=True,
                              logs=lambda job: genuine_result(job, 2.2)))
    slowest = 0.0

    # The retry's log streams: its result comes back.
    server.script_next(Script(stage="COMPLETED", logs=lambda job: genuine_result(job, 2.2)))

    def done() -> bool:
        return phase(lab, "stalled") in ("Failed", "Succeeded")
    deadline = time.time() + 30
    while not done() and time.time() < deadline:
        t0 = time.time()
        lab.step()
        slowest = max(slowest, time.time() - t0)
        time.sleep(0.05)
    st = lab.read_record("stalled")["status"]
    assert st["phase"] == "Succeeded", st
    assert slowest < 1.5, f"a pass took {slowest:.1f} s: a stalled stream held up the loop"
    # The stalled try is lost (not a measurement of the candidate) and runs again, and this
    # time its result comes back.
    [lost] = st["lostRuns"]
    assert lost["run"] == "exp-stalled-1" and lost["state"] == "error"
    assert "stalled" in lost["reason"] and "may run again" in lost["reason"]
    assert runs_of(lab, "stalled") == [("exp-stalled-1", "lost", ""),
                                       ("exp-stalled-1-t2", "succeeded", "2.2")]
    assert st["metrics"]["val_bpb"] == 2.2 and st["run"] == "exp-stalled-1-t2"


def run_for(lab: LocalLab, server: FakeJobsServer, clock: FakeClock, name: str,
            seconds: float = 600, throttle_at: float | None = None) -> dict:
    """Step the loop once per simulated second while the job trains for `seconds`, printing a
    line every 10 s; then it ends with its signed result. Returns facts about the run."""
    server.script_next(Script(hold=True))
    apply(lab, name)
    start, job, ended = clock.t, None, None
    facts: dict = {"throttled_at": None}
    while clock.t - start < seconds + 120:
        clock.t += 1.0
        lab.step()
        job = job or (server.created() or [None])[-1]
        if job is not None and job.stage == "RUNNING":
            if throttle_at is not None and facts["throttled_at"] is None \
                    and clock.t - start >= throttle_at:
                server.throttle(1, seconds=30)
                facts["throttled_at"] = clock.t
            if int(clock.t - start) % 10 == 0:
                server.log(job, f"step {int(clock.t - start)} loss 3.1")
            if clock.t - start >= seconds and ended is None:
                server.finish(job, logs=genuine_result(job, 2.1))
                ended = clock.t
        time.sleep(0.005)  # the log thread takes its lines (real time)
        if phase(lab, name) == "Succeeded":
            break
    facts.update(job=job, ended=ended, recorded=clock.t)
    return facts


def test_a_ten_minute_run_costs_at_most_100_api_calls(server, tmp_path, monkeypatch):
    for k, v in (("poll_min_seconds", 2.0), ("poll_max_seconds", 60.0),
                 ("log_retry_seconds", 5.0)):
        monkeypatch.setattr(HfBackend, k, v)  # the shipped numbers, in simulated time
    clock = FakeClock()
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").clock = server.clock = clock
    server.min_inspect_interval = 1.0  # a client polling faster is told to slow down (429)
    before = sum(server.calls().values())
    facts = run_for(lab, server, clock, "ten-minutes", seconds=600)
    assert phase(lab, "ten-minutes") == "Succeeded"
    assert lab.read_record("ten-minutes")["status"]["metrics"]["val_bpb"] == 2.1
    calls = server.calls()
    total = sum(calls.values()) - before
    print(f"API calls for a 10-minute run: {total} {dict(calls)}")
    assert total <= 100, dict(calls)
    assert calls["logs"] <= 3 and not server.throttled
    assert facts["recorded"] - facts["ended"] <= 10  # the end is seen within seconds
    log = (lab.root / ".autolab" / "runs" / "exp-ten-minutes-1" / "log.txt").read_text()
    assert "step 300 loss 3.1" in log  # the followed stream kept the whole log


@pytest.mark.parametrize("as_date", [False, True], ids=["seconds", "http-date"])
def test_a_429_stops_every_call_until_its_retry_after(server, tmp_path, monkeypatch, as_date):
    for k, v in (("poll_min_seconds", 2.0), ("poll_max_seconds", 60.0)):
        monkeypatch.setattr(HfBackend, k, v)
    clock = FakeClock()
    lab = make_lab(tmp_path / "lab")
    lab.backend_for("hf").clock = server.clock = clock
    server.retry_after_as_date = as_date
    run_for(lab, server, clock, "throttled", seconds=120, throttle_at=20)
    assert phase(lab, "throttled") == "Succeeded"
    [refused] = server.throttled
    later = [r for r in server.requests if r["at"] > refused["at"]]
    assert later and min(r["at"] for r in later) >= refused["at"] + 30 - 1, \
        [(r["kind"], r["at"] - refused["at"]) for r in later[:3]]


def test_a_namespace_the_token_may_not_use_is_told_with_the_servers_words_and_the_fix(
        server, tmp_path):
    lab = make_lab(tmp_path / "lab", hf={"namespace": "autolab-org"})
    server.forbid("autolab-org", "Organization autolab-org does not allow this token to run "
                                 "jobs")
    apply(lab, "org-run")
    with pytest.raises(HfBackendError) as e:
        step_until(lab, lambda: False, timeout=5)
    message = str(e.value)
    assert "Organization autolab-org does not allow this token to run jobs" in message
    assert "403" in message and "namespace autolab-org" in message
    for fix in ("hf auth login", "spec.hf.namespace", "write access", "Jobs"):
        assert fix in message, fix
    assert not server.created()


def test_a_job_carries_the_evaluation_limit_the_controller_sets_and_the_entry_point_takes_it(
        server, tmp_path):
    """The bound on a candidate's evaluation (core.evaluation: 5 x the master's, here 30 s)
    reaches the job's command, in words its entry point parses and hands to run.py."""
    import importlib.util

    lab = make_lab(tmp_path / "lab")
    doc = yaml.safe_load((lab.root / "lab.yaml").read_text())
    doc["spec"]["profile"] = "default"  # eval_timeout 600 s: the bound is the tighter
    (lab.root / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    lab = LocalLab(lab.root)
    (lab.root / "research" / "live").mkdir(parents=True, exist_ok=True)
    (lab.root / "research" / "live" / "evaluation.json").write_text(json.dumps(
        {"master": lab.repo.master().hash, "evaluateSeconds": 30.0, "profile": "default"}))
    apply(lab, "lr-up")
    server.script_next(Script(stage="RUNNING", running_polls=1000))
    step_until(lab, lambda: server.created())
    command = server.created()[0].spec["command"]
    assert command[command.index("--eval-limit") + 1] == "150"
    spec = importlib.util.spec_from_file_location("hf_entry_under_test", REPO / "bench" / "hf_entry.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    assert entry.parser().parse_args(command[3:]).eval_limit == 150.0


def test_a_bundle_longer_than_one_environment_variable_travels_in_several_and_unpacks_whole():
    """The harness alone is ~83 KiB of base64, near what one environment string may hold: a
    larger bundle is split over AUTOLAB_BUNDLE, AUTOLAB_BUNDLE_1, ..., and the job's real
    bootstrap joins them before it unpacks (a candidate's lines must not be what breaks a job)."""
    import os
    import subprocess
    import sys

    from controller.backends.hf_wire import BOOTSTRAP, BUNDLE_PART, bundle_env, make_bundle

    big = os.urandom(100_000).hex().encode()  # ~100 KiB once packed: more than one part
    entry = (b"import pathlib, sys\n"
             b"print(len((pathlib.Path(__file__).parent / 'big.txt').read_bytes()), *sys.argv[1:])\n")
    env = bundle_env(make_bundle({"bench/hf_entry.py": entry, "bench/big.txt": big}))
    assert len(env) >= 2 and all(len(v) <= BUNDLE_PART for v in env.values())
    ran = subprocess.run([sys.executable, "-c", BOOTSTRAP, "run", "--run", "r"],
                         env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == [str(len(big)), "run", "--run", "r"]
