"""`autolab hf ...`: what a person sees before spending money, against the stand-in service."""

from __future__ import annotations

import re

import pytest
import yaml

from controller.cli import hf, main as cli
from controller.backends import hf as backend
from controller.local import init_lab
from hf_server import FakeJobsServer, Script

TOKEN = "hf_CLItokenNotForPrinting5550123"


@pytest.fixture()
def server(tmp_path, monkeypatch):
    srv = FakeJobsServer(TOKEN, work_dir=tmp_path).start()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", srv.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    yield srv
    srv.stop()


@pytest.fixture()
def lab_dir(tmp_path):
    root = tmp_path / "lab"
    init_lab(root, profile="default", data="hub")
    doc = yaml.safe_load((root / "lab.yaml").read_text())
    doc["spec"]["backend"] = "hf"
    doc["spec"]["hf"] = {"namespace": "alice", "bucket": "autolab-cache", "flavor": "h200",
                         "timeout": "30m"}
    (root / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return root


def run(capsys, *argv: str) -> tuple[int, str]:
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:  # --help
        rc = e.code
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err
    return rc, out.out + out.err


@pytest.mark.parametrize("command", [("hf", "--help"), ("hf", "preflight", "--help")])
def test_help_tells_a_new_user_what_to_set_and_what_a_run_costs(capsys, command):
    rc, out = run(capsys, *command)
    assert rc == 0
    for what in ("hf auth login", "HF_TOKEN", "namespace:", "bucket:", "flavor:", "timeout:",
                 "backend: hf", "autolab hf prepare", "autolab hf preflight",
                 "hf buckets create", "trains for the lab's budget", "start-up allowance",
                 "billed"):
        assert what in out, what
    # The defaults it quotes are the backend's.
    assert (hf.DEFAULT_FLAVOR, hf.DEFAULT_TIMEOUT, hf.PREPARE_FLAVOR, hf.PREPARE_TIMEOUT) == \
        (backend.DEFAULT_FLAVOR, backend.DEFAULT_TIMEOUT, backend.PREPARE_FLAVOR,
         backend.PREPARE_TIMEOUT)
    if command == ("hf", "--help"):
        for sub in ("preflight", "prepare", "jobs", "logs"):
            assert sub in out


def test_preflight_shows_who_where_the_price_and_the_cost_of_one_run(server, lab_dir, capsys):
    bucket = server.add_bucket("alice/autolab-cache", lab_dir.parent / "bucket")
    (bucket / "data").mkdir()
    (bucket / "data" / "manifest.json").write_text("{}")
    server.script_next(Script(hold=True))
    server.script_next(Script(hold=True))
    b = backend.HfBackend.from_lab(hf.LocalLab(lab_dir).lab, lab_dir)
    b.api.run_job(image="x", command=["true"], namespace="alice", labels=b.labels(
        "exp-a-1", "a", "", "run"))
    b.api.run_job(image="x", command=["true"], namespace="alice",  # another lab's job
                  labels={backend.LABEL_LAB_ID: "someoneelse", backend.LABEL_RUN: "exp-b-1"})
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir))
    assert rc == 0, out
    assert "token:      from HF_TOKEN; user alice (orgs: autolab-org)" in out
    assert "namespace:  alice\n" in out
    assert "alice/autolab-cache: private, 1 files" in out
    assert "h200 (Nvidia 1xH200, 1x H200 141 GB" in out and "$0.083333 per minute" in out
    assert "in flight:  1 job(s) of this lab" in out and "exp-a-1" in out
    assert "exp-b-1" not in out
    # default profile: 300 s budget + 180 s allowance, boot and evaluation estimated
    assert "training budget 300 s + start-up allowance 180 s" in out
    m = re.search(r"about ([\d.]+) min, about \$([\d.]+); at most 30.0 min \(timeout 30m\), "
                  r"\$([\d.]+)", out)
    assert m, out
    minutes = (hf.BOOT_ESTIMATE_SECONDS + 300 + 180 + hf.EVAL_ESTIMATE_SECONDS) / 60
    assert float(m[1]) == pytest.approx(minutes, abs=0.05)
    assert float(m[2]) == pytest.approx(minutes * 0.083333, abs=0.01)
    assert float(m[3]) == pytest.approx(30 * 0.083333, abs=0.01)
    assert "shorter than the longest" not in out  # 300 + 180 + 600 + boot < 30 min
    assert out.rstrip().endswith("ready: yes")

    doc = yaml.safe_load((lab_dir / "lab.yaml").read_text())
    doc["spec"]["hf"]["timeout"] = "15m"
    (lab_dir / "lab.yaml").write_text(yaml.safe_dump(doc))
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir))
    assert "timeout 15m is shorter than the longest a run may legitimately take" in out


def test_preflight_says_what_is_missing_and_fails(server, lab_dir, capsys, monkeypatch):
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir), "--flavor", "h9000")
    assert rc == 1
    assert "bucket alice/autolab-cache does not exist" in out
    assert "hf buckets create alice/autolab-cache --private" in out
    assert "flavor h9000 is not offered; known flavors: cpu-upgrade, h200, l4x1" in out
    assert out.rstrip().endswith("ready: no")
    monkeypatch.delenv("HF_TOKEN")
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir))
    assert rc == 1 and "no token: run `hf auth login` or set HF_TOKEN" in out


def test_preflight_tells_a_rejected_token_from_a_hub_out_of_reach(server, lab_dir, capsys,
                                                                 monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_notTheTokenTheServerKnows01")
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir))
    assert rc == 1 and "REJECTED (401)" in out and "hf auth login" in out
    import socket
    with socket.socket() as s:  # a port nobody listens on: no network to the Hub
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir))
    assert rc == 1 and "REJECTED" not in out
    assert "NOT CHECKED" in out and "cannot reach the Hub" in out


def test_prepare_starts_one_cpu_job_on_the_bucket_and_not_a_second(server, lab_dir, capsys):
    server.add_bucket("alice/autolab-cache", lab_dir.parent / "bucket")
    server.script_next(Script(hold=True))
    rc, out = run(capsys, "hf", "prepare", "--lab", str(lab_dir))
    assert rc == 0 and "prepare job" in out and "hub for the default profile" in out
    [job] = server.created()
    assert job.spec["flavor"] == "cpu-upgrade" and job.spec["timeoutSeconds"] == 2 * 3600
    command = job.spec["command"]
    assert command[3:] [:7] == ["prepare", "--profile", "default", "--source", "hub",
                                "--data-mount", "/autolab-data"]
    assert not any(r.startswith("torch") for r in command)  # data preparation needs no torch
    assert job.spec["volumes"][0]["readOnly"] is False
    assert set(job.spec["secrets"]) == {"HF_TOKEN"}
    rc, out = run(capsys, "hf", "prepare", "--lab", str(lab_dir))
    assert rc == 0 and f"already SCHEDULING: {job.id}" in out
    assert len(server.created()) == 1


def test_jobs_and_logs_show_the_labs_jobs_without_the_token(server, lab_dir, capsys):
    server.add_bucket("alice/autolab-cache", lab_dir.parent / "bucket")
    server.script_next(Script(hold=True, logs=["step 10 loss 4.2", f"token={TOKEN}"]))
    run(capsys, "hf", "prepare", "--lab", str(lab_dir))
    [job] = server.created()
    rc, out = run(capsys, "hf", "jobs", "--lab", str(lab_dir))
    assert rc == 0 and job.id in out and "prepare" in out
    for _ in range(2):
        server._advance(job)  # SCHEDULING -> RUNNING: the log starts
    rc, out = run(capsys, "hf", "logs", "--lab", str(lab_dir), "--job", job.id)
    assert rc == 0 and "step 10 loss 4.2" in out and "token=[redacted]" in out


def test_preflight_tells_a_forbidden_namespace_with_the_servers_words_and_the_fix(
        server, lab_dir, capsys):
    """issue 13: an organisation the token may not run jobs in (it is a member all the same)."""
    doc = yaml.safe_load((lab_dir / "lab.yaml").read_text())
    doc["spec"]["hf"]["namespace"] = "autolab-org"
    (lab_dir / "lab.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    server.forbid("autolab-org", "This token has no permission to run jobs for autolab-org")
    rc, out = run(capsys, "hf", "preflight", "--lab", str(lab_dir))
    assert rc == 1 and out.rstrip().endswith("ready: no")
    assert "REFUSED (403)" in out
    problem = [line for line in out.splitlines() if line.startswith("problem:") and "403" in line]
    assert problem, out
    for what in ("This token has no permission to run jobs for autolab-org", "namespace "
                 "autolab-org", "hf auth login", "spec.hf.namespace", "write access"):
        assert what in problem[0], what
    rc, out = run(capsys, "hf", "jobs", "--lab", str(lab_dir))  # one line, no traceback
    assert rc != 0 and "This token has no permission" in out and "spec.hf.namespace" in out
    assert "Traceback" not in out
