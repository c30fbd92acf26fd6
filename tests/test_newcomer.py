"""A newcomer's first hour (issue 14): every command the README shows works as written, and the
kubectl habits people bring along work too. Each test runs the real `autolab` executable (or
`./dev`) the way a person types it, and checks what that person sees: the exit code, the printed
text, the files."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from controller.cli.lab import init_lab

REPO = Path(__file__).resolve().parents[1]
AUTOLAB = Path(sys.executable).with_name("autolab")
COMMAND = [str(AUTOLAB)] if AUTOLAB.exists() else [sys.executable, "-m", "controller.cli.main"]
TIMEOUT = 120


@pytest.fixture(scope="module")
def seed_lab(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seed")
    init_lab(root / "mylab", profile="tiny", data="synthetic")
    return root / "mylab"


@pytest.fixture()
def lab(seed_lab, tmp_path) -> Path:
    """A fresh copy of a tiny lab for one test."""
    return Path(shutil.copytree(seed_lab, tmp_path / "mylab", symlinks=True))


@pytest.fixture()
def env(tmp_path) -> dict:
    e = {k: v for k, v in os.environ.items()
         if not k.startswith(("HF_", "HUGGING_FACE", "GIT_", "AUTOLAB_"))}
    e.update(GIT_CEILING_DIRECTORIES=str(tmp_path), HF_HOME=str(tmp_path / "hf-home"),
             AUTOLAB_TRACKING="0")
    return e


def autolab(*args: str, env: dict, cwd: Path | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*COMMAND, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=TIMEOUT, **kw)


def master_hash(lab: Path) -> str:
    return yaml.safe_load((lab / "research" / "live" / "master.json").read_text())["hash"]


def readme_spec() -> dict:
    """The Experiment the README shows, as a newcomer copies it."""
    text = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
                 if "kind: Experiment" in b)
    return yaml.safe_load(block)


def write_spec(path: Path, name: str, parent: str, diff: str, hypothesis: str = "A change.") -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment", "metadata": {"name": name},
        "spec": {"hypothesis": hypothesis, "parent": parent, "diff": diff}}, sort_keys=False))
    return path


WARMDOWN = "WARMDOWN_RATIO = 0.5  # share of the budget at the end spent decaying the LR"


def zero_context_diff(old: str, new: str, line: int = 62) -> str:
    return f"--- a/train.py\n+++ b/train.py\n@@ -{line} +{line} @@\n-{old}\n+{new}\n"


# -- 1. the README's spec: a hunk with no context lines -----------------------------------------

def test_the_readmes_example_spec_validates_and_applies(lab, env):
    doc = readme_spec()
    assert re.search(r"^@@ -\d+ \+\d+ @@$", doc["spec"]["diff"], re.M), "no zero-context hunk"
    doc["spec"]["parent"] = master_hash(lab)[:12]  # what `autolab master` prints
    f = lab / "warmdown-03.yaml"
    f.write_text(yaml.safe_dump(doc, sort_keys=False))
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "warmdown-03: ok" in p.stdout
    p = autolab("apply", "-f", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 0 and "warmdown-03 created" in p.stdout, p.stderr


def test_zero_context_hunk_with_the_wrong_line_is_refused_without_blaming_the_master(lab, env):
    f = write_spec(lab / "bad.yaml", "bad-warmdown", master_hash(lab)[:12],
                   zero_context_diff("WARMDOWN_RATIO = 0.9", "WARMDOWN_RATIO = 0.3"))
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1
    assert "DiffDoesNotApply" in p.stdout and "(the current master)" in p.stdout
    assert "older than the current" not in p.stdout and "regenerate" not in p.stdout


def test_a_diff_against_an_older_master_that_does_not_apply_says_the_master_moved(lab, env):
    from controller.core.hashing import candidate_hash, semantic_hash
    from controller.local import LocalLab

    seed = master_hash(lab)
    local = LocalLab(lab)
    src = local.repo.master_source().replace("DEPTH = 8", "DEPTH = 9", 1)
    (lab / "bench" / "train.py").write_text(src)
    local.repo.git("commit", "-qam", "deeper")
    commit = local.repo.git("rev-parse", "HEAD").stdout.strip()
    local.repo.set_master_metric(2.0)
    assert local.repo.promote("deeper", commit, 1.0, (candidate_hash(src), semantic_hash(src)),
                              seed, "2024-01-01T00:00:00Z", margin=0.0).promoted
    f = write_spec(lab / "stale.yaml", "stale-bad", seed[:12],
                   zero_context_diff("WARMDOWN_RATIO = 0.9", "WARMDOWN_RATIO = 0.3"))
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1
    assert "older than the current one" in p.stdout and "regenerate" in p.stdout


def test_zero_context_hunk_may_not_touch_another_file(lab, env):
    diff = "--- a/prepare.py\n+++ b/prepare.py\n@@ -1 +1 @@\n-a\n+b\n"
    f = write_spec(lab / "other.yaml", "other-file", master_hash(lab)[:12], diff)
    p = autolab("validate", str(f), "--lab", str(lab), env=env)
    assert p.returncode == 1 and "DiffTouchesOtherFile" in p.stdout
