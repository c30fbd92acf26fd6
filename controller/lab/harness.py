"""The harness a lab was made with, pinned: the git blobs of its first commit's bench/.

Every backend runs this copy, never the lab's editable `bench/`, so a candidate (or a
person) who edits `bench/prepare.py` changes nothing that measures.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from controller.core.errors import MachineError
from controller.lab.files import atomic_write
from controller.lab.paths import LabPaths

HARNESS_FILES = ("prepare.py", "run.py", "evaluate.py", "sandbox.py")


def git_bytes(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`git ARGS` in `root`, output as bytes (blobs are compared byte for byte)."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True)


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HarnessError(MachineError, RuntimeError):
    """The lab's pinned harness cannot be read from its first commit."""


def _first_commit(root: Path) -> str | None:
    out = git_bytes(root, "rev-list", "--max-parents=0", "autolab/master")
    roots = out.stdout.decode().split()
    return roots[-1] if out.returncode == 0 and roots else None


def starting_program(root: Path, surface: str = "bench/train.py") -> bytes | None:
    """The bytes of the lab's starting train.py (its first commit's surface): its owner's code, the
    one program whose compile cache every run may start from (bench/run.py, COMPILE_SEEDS), and
    the one a harness may run, before a candidate, to build that cache on a machine that has none."""
    commit = _first_commit(root)
    if commit is None:
        return None
    out = git_bytes(root, "show", f"{commit}:{surface}")
    return out.stdout if out.returncode == 0 else None


def starting_program_sha1(root: Path, surface: str = "bench/train.py") -> str | None:
    """The sha1 of the lab's starting train.py (see starting_program)."""
    code = starting_program(root, surface)
    return hashlib.sha1(code).hexdigest() if code is not None else None


def pinned_harness(root: Path) -> Path:
    """The harness the lab was made with: `.autolab/harness/<commit>/`, written from the git
    blobs of the lab's first commit and checked against them (blob ids) on every call. Runs on
    every backend use it, never the lab's editable bench/."""
    commit = _first_commit(root)
    if commit is None:
        raise HarnessError(f"{root}: cannot find the lab's first commit (no branch autolab/master)")
    pinned = LabPaths.of(root).state / "harness" / commit[:12]
    for name in HARNESS_FILES:
        want = git_bytes(root, "rev-parse", f"{commit}:bench/{name}")
        if want.returncode != 0:
            raise HarnessError(f"the lab's first commit {commit[:12]} has no bench/{name}: this "
                               "lab was made by an older autolab; make a new one with `autolab init`")
        blob = want.stdout.decode().strip()
        path = pinned / name
        if path.is_file() and _blob_id(path.read_bytes()) == blob:
            continue
        data = git_bytes(root, "cat-file", "blob", blob).stdout
        if _blob_id(data) != blob:
            raise HarnessError(f"git returned other bytes for bench/{name} ({blob[:12]})")
        pinned.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data.decode("utf-8"))
    return pinned
