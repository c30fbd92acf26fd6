"""The harness is pinned as one unit: bench/HARNESS lists its files, and a lab runs the copy of
every one of them (and of the manifest) that its first commit holds.

A lab made before the manifest pinned four files (the one-file run.py and its helpers); it keeps
running with exactly those. An edit to any harness module in a lab's bench/, by a candidate or by
a person, changes nothing that measures.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.lab.harness import (LEGACY_HARNESS_FILES, MANIFEST, HarnessError, harness_digest,
                                    harness_files, manifest_files, pinned_files, pinned_harness)
from labkit import spec_from_edit

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
AUTOLAB = [sys.executable, "-m", "controller.cli.main"]
# The last commit whose harness was the one-file run.py: a lab made then pinned these bytes.
BEFORE_THE_MANIFEST = "e731df4"
EDIT = ("shorter", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.45")


def old_bench(tmp_path: Path) -> Path:
    """bench/ as `autolab init` copied it before the manifest: the four harness files, train.py
    and its readme, from git."""
    src = tmp_path / "old-bench"
    src.mkdir()
    for name in (*LEGACY_HARNESS_FILES, "train.py", "README.md"):
        old = subprocess.run(["git", "show", f"{BEFORE_THE_MANIFEST}:bench/{name}"], cwd=REPO,
                             capture_output=True)
        if old.returncode != 0:
            pytest.skip(f"this checkout has no commit {BEFORE_THE_MANIFEST} (a shallow clone)")
        (src / name).write_bytes(old.stdout)
    return src


def make_lab(tmp_path: Path, monkeypatch, bench: Path | None = None):
    """A tiny lab on synthetic data made from `bench` (today's bench/ if None), its master's
    metric set high so that any run that measures is promoted."""
    from controller.cli.lab import init_lab
    from controller.lab import init

    if bench is not None:
        monkeypatch.setattr(init, "bench_source_dir", lambda: bench)
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2, min_delta=0)
    lab.repo.set_master_metric(9.9)
    return lab


def run_one(lab, tmp_path: Path) -> tuple[dict, list[str]]:
    """Submit EDIT as an experiment and `autolab run` until it is done: its result and the
    command its harness ran (without bubblewrap here: --unsafe-no-sandbox)."""
    lab.apply_file(spec_from_edit(lab, *EDIT, "A slightly shorter warmdown."), "test")
    env = dict(os.environ, PYTHONPATH=str(REPO), AUTOLAB_CACHE=str(tmp_path / "cache"))
    cmd = AUTOLAB + ["run", "--lab", str(lab.root), "--interval", "0.2"]
    if shutil.which("bwrap") is None:
        cmd.append("--unsafe-no-sandbox")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    run = lab.root / ".autolab" / "runs" / f"exp-{EDIT[0]}-1"
    return json.loads((run / "result.json").read_text()), json.loads((run / "launch.json").read_text())["cmd"]


def test_the_manifest_lists_every_harness_module_and_the_entry_point():
    listed = harness_files(BENCH)
    assert listed[-1] == MANIFEST and "run.py" in listed
    modules = {p.name for p in BENCH.glob("harness_*.py")}
    assert modules and modules <= set(listed), "a harness module the manifest does not list is not pinned"
    assert {"prepare.py", "evaluate.py", "sandbox.py"} <= set(listed) and "train.py" not in listed
    for name in listed:
        assert (BENCH / name).is_file(), name
        if name.endswith(".py"):
            assert len((BENCH / name).read_text().splitlines()) <= 900 or name in ("prepare.py", "evaluate.py"), \
                f"{name}: a harness module of one concern stays under 900 lines"


def test_a_manifest_naming_a_path_outside_bench_is_refused():
    with pytest.raises(HarnessError, match="plain file names"):
        manifest_files("run.py\n../controller/evil.py\n")
    with pytest.raises(HarnessError, match="run.py"):
        manifest_files("prepare.py  # no entry point\n")


def test_a_lab_made_before_the_manifest_runs_an_experiment_with_the_four_files_it_pinned(tmp_path, monkeypatch):
    old = old_bench(tmp_path)
    lab = make_lab(tmp_path, monkeypatch, old)
    assert pinned_files(lab.root) == LEGACY_HARNESS_FILES
    pinned = pinned_harness(lab.root)
    assert sorted(p.name for p in pinned.iterdir() if p.is_file()) == sorted(LEGACY_HARNESS_FILES)
    for name in LEGACY_HARNESS_FILES:
        assert (pinned / name).read_bytes() == (old / name).read_bytes(), name

    result, cmd = run_one(lab, tmp_path)
    assert result["status"] == "succeeded", result["reason"]
    assert result["metrics"]["val_bpb"] > 0
    assert cmd[cmd.index("-I") + 1] == str(pinned / "run.py"), "the old lab's own one-file run.py measured it"
    assert not (pinned / MANIFEST).exists() and not list(pinned.glob("harness_*.py"))


def test_editing_any_harness_file_in_the_labs_bench_changes_nothing_that_measures(tmp_path, monkeypatch):
    lab = make_lab(tmp_path, monkeypatch)
    assert pinned_files(lab.root) == harness_files(BENCH)
    pinned = pinned_harness(lab.root)
    digest = harness_digest(pinned)
    assert digest == harness_digest(BENCH)

    # A person commits a broken harness to the lab's bench/, every file of it, the manifest too
    # (a new module listed, the entry point's siblings made to fail on import).
    bench = lab.root / "bench"
    for name in harness_files(BENCH):
        path = bench / name
        path.write_text(path.read_text() + ("\nextra.py\n" if name == MANIFEST else "\nraise SystemExit(9)\n"))
    (bench / "extra.py").write_text("raise SystemExit(9)\n")
    subprocess.run(["git", "add", "-A", "bench"], cwd=lab.root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "edit the harness"],
                   cwd=lab.root, check=True)
    # ... and something rewrites a module of the pinned copy.
    (pinned / "harness_figures.py").write_text("raise SystemExit(9)\n")

    assert pinned_files(lab.root) == harness_files(BENCH), "the pin is the first commit's manifest"
    assert harness_digest(pinned_harness(lab.root)) == digest, "the pinned copy is rewritten from git"
    assert not (pinned / "extra.py").exists()

    result, cmd = run_one(lab, tmp_path)
    assert result["status"] == "succeeded", result["reason"]
    assert cmd[cmd.index("-I") + 1] == str(pinned / "run.py")
    assert harness_digest(pinned) == digest


def test_run_py_imports_its_modules_from_its_own_directory_whatever_the_working_directory_holds(tmp_path):
    """`python -I run.py` from a directory full of modules named like the harness's (a candidate's
    scratch is its working directory when it runs unsandboxed): none of them is imported."""
    for name in [*harness_files(BENCH), "prepare.py", "sandbox.py"]:
        if name.endswith(".py") and name != "run.py":
            (tmp_path / name).write_text("raise SystemExit('imported the wrong ' + __file__)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--candidate" in done.stdout, done.stdout + done.stderr
