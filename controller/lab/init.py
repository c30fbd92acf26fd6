"""Making a lab: a git repo with the pinned bench, the research folders and a seeded master.

`autolab init` and the operator (for a Lab it has no directory for yet) both call
`make_lab`, so a lab made on a laptop and one made in a cluster look the same
(`controller.local.init_lab` makes one and opens it, for benchmarks and tests).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from controller.core.errors import InputError
from controller.core.spec import API_VERSION, LabSpec
from controller.lab.harness import harness_files
from controller.lab.paths import LAB_FILE
from controller.lab.repo import LabRepo

REPO_ROOT = Path(__file__).resolve().parents[2]
# Copied into a new lab's bench/ beside the harness (every file bench/HARNESS lists, and the
# manifest): the surface and its readme.
BENCH_FILES = ("train.py", "README.md")
RESEARCH_FILES = {
    "notes.md": "# Lab notes\n\nHand-written: what we believe, what we tried, what to try next.\n",
    "do-not-repeat.md": "# Do not repeat\n\nIdeas that regressed or were duplicates, by campaign."
                        " The controller appends here; people may annotate.\n",
}

# `autolab init --profile tiny` (and the demo) write `promotion.maxPairs: 3`: the tiny profile is a
# CPU smoke test whose 4-s runs spread with the machine's load, so a decision that went to the
# default cap of 10 pairs would keep a first `autolab run` busy for minutes and resolve nothing a
# GPU lab would trust. Three pairs still need a significant paired t to promote.
SMOKE_MAX_PAIRS = {"tiny": 3}


def default_max_pairs(profile: str, min_delta: float | str | None) -> int | None:
    """The `promotion.maxPairs` a new lab of `profile` is written with (None: the default cap);
    a numeric minDelta lets one pair decide, and keeps it so."""
    return SMOKE_MAX_PAIRS.get(profile) if min_delta in (None, "auto") else None


class LabInitError(InputError, RuntimeError):
    """The lab cannot be made here (it exists already, or the bench sources are missing)."""


def bench_source_dir() -> Path:
    d = REPO_ROOT / "bench"
    if not (d / "prepare.py").exists():
        raise LabInitError(f"cannot find the benchmark sources at {d}; install autolab from a "
                           "checkout (pip install -e .)")
    return d


def make_lab(target: Path, profile: str = "default", data: str = "hub", name: str = "default",
             budget: int | None = None, min_delta: float | str | None = None,
             max_pairs: int | None = None) -> Path:
    """Create a lab in `target` and return its resolved path. `min_delta` and `max_pairs`, if
    given, are written as the lab's `promotion.minDelta` (`autolab init` writes "auto") and
    `promotion.maxPairs`."""
    target = target.resolve()
    if (target / LAB_FILE).exists():
        raise LabInitError(f"{target} is already a lab ({LAB_FILE} exists)")
    target.mkdir(parents=True, exist_ok=True)
    src = bench_source_dir()
    (target / "bench").mkdir(exist_ok=True)
    for f in (*harness_files(src), *BENCH_FILES):
        if (src / f).exists():
            shutil.copy2(src / f, target / "bench" / f)
    research = target / "research"
    for sub in ("experiments", "campaigns", "live", "templates"):
        (research / sub).mkdir(parents=True, exist_ok=True)
        (research / sub / ".gitkeep").touch()
    for fname, text in RESEARCH_FILES.items():
        if not (research / fname).exists():
            (research / fname).write_text(text)
    templates = REPO_ROOT / "research" / "templates"
    if templates.exists():
        for t in templates.glob("*.md"):
            shutil.copy2(t, research / "templates" / t.name)
    (target / "experiments").mkdir(exist_ok=True)
    (target / "experiments" / ".gitkeep").touch()
    spec: dict = {"profile": profile, "data": data, "backend": "local"}
    if budget:
        spec["budgetSeconds"] = budget
    if min_delta is not None:
        spec.setdefault("promotion", {})["minDelta"] = min_delta
    if max_pairs is not None:
        spec.setdefault("promotion", {})["maxPairs"] = max_pairs
    lab_doc = {"apiVersion": API_VERSION, "kind": "Lab", "metadata": {"name": name},
               "spec": spec}
    (target / LAB_FILE).write_text(yaml.safe_dump(lab_doc, sort_keys=False))
    (target / ".gitignore").write_text(".autolab/\n__pycache__/\n*.lock\n")
    git = ["git", "-c", "user.name=autolab", "-c", "user.email=autolab@localhost",
           "-c", "commit.gpgsign=false"]
    if not (target / ".git").exists():
        subprocess.run(git + ["init", "-q", "-b", "main"], cwd=target, check=True)
    subprocess.run(git + ["add", "-A"], cwd=target, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "Seed the lab"], cwd=target, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=target, capture_output=True,
                            text=True, check=True).stdout.strip()
    LabRepo(target, LabSpec.from_dict(spec)).seed_master(commit)
    return target


