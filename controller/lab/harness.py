"""The harness a lab was made with, pinned: the git blobs of its first commit's bench/.

Every backend runs this copy, never the lab's editable `bench/`, so a candidate (or a
person) who edits `bench/prepare.py`, or any other harness module, changes nothing that
measures.

The harness is one versioned unit. `bench/HARNESS` (the manifest) lists its files, one a
line: `run.py` (the entry point, `python -I run.py`), its `harness_*.py` modules of one
concern each, `prepare.py` and `evaluate.py` with their `prepare_*.py` and `evaluate_*.py`
parts, and `sandbox.py`. The manifest is the one list:
pinning, bundling a job, restoring a lab's bench/ and the harness's own check that nothing
changed it mid-run all read it, and the pin holds over every file it lists and over the
manifest itself. `harness_digest` names a pinned harness by one hash over all of them.

A lab made before the manifest (its first commit has the four files
`LEGACY_HARNESS_FILES` and no `bench/HARNESS`) is not migrated: it runs with the files it
pinned, its one-file run.py, as it always did. Moving it to today's harness would change
what measures its master mid-campaign; a new lab (`autolab init`) gets the new one.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from controller.core.errors import MachineError
from controller.lab.files import atomic_write
from controller.lab.paths import LabPaths

MANIFEST = "HARNESS"  # bench/HARNESS: the harness's files, one a line ('#' starts a comment)
# What a lab made before the manifest pinned: the harness was one run.py and its three helpers.
LEGACY_HARNESS_FILES = ("prepare.py", "run.py", "evaluate.py", "sandbox.py")


class HarnessError(MachineError, RuntimeError):
    """The lab's pinned harness cannot be had (no first commit, a file missing, a bad manifest)."""


def manifest_files(text: str) -> tuple[str, ...]:
    """The file names a manifest lists, in its order. Each must be a plain name in bench/ (no
    directory, no dot file): the pin is a flat directory, and the entry point imports its
    siblings from there."""
    names = []
    for raw in text.splitlines():
        name = raw.split("#", 1)[0].strip()
        if not name:
            continue
        if "/" in name or "\\" in name or name.startswith(".") or name == MANIFEST:
            raise HarnessError(f"bench/{MANIFEST} lists {name!r}: only plain file names of bench/ may be "
                               "listed (the manifest itself is pinned without being listed)")
        names.append(name)
    if "run.py" not in names:
        raise HarnessError(f"bench/{MANIFEST} does not list run.py, the harness's entry point")
    return tuple(names)


def harness_files(bench: Path) -> tuple[str, ...]:
    """Every file of the harness in the directory `bench` (a checkout's bench/, a pinned copy):
    the manifest's files and the manifest; the four legacy files where there is no manifest."""
    manifest = bench / MANIFEST
    if not manifest.is_file():
        return LEGACY_HARNESS_FILES
    return (*manifest_files(manifest.read_text()), MANIFEST)


def harness_digest(bench: Path) -> str:
    """One sha256 over every file of the harness in `bench` (names and bytes, in the manifest's
    order): two directories with the same digest measure alike."""
    h = hashlib.sha256()
    for name in harness_files(bench):
        h.update(b"%s\0%s\n" % (name.encode(), hashlib.sha256((bench / name).read_bytes()).digest()))
    return h.hexdigest()


def git_bytes(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`git ARGS` in `root`, output as bytes (blobs are compared byte for byte)."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True)


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _first_commit(root: Path) -> str | None:
    out = git_bytes(root, "rev-list", "--max-parents=0", "autolab/master")
    roots = out.stdout.decode().split()
    return roots[-1] if out.returncode == 0 and roots else None


def starting_program(root: Path, surface: str = "bench/train.py") -> bytes | None:
    """The bytes of the lab's starting train.py (its first commit's surface): its owner's code, the
    one program whose compile cache every run may start from (bench/harness_compile_cache.py, COMPILE_SEEDS), and
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


def pinned_files(root: Path) -> tuple[str, ...]:
    """The names of the harness files the lab pinned: those its first commit's bench/HARNESS
    lists and the manifest, or the four legacy files where that commit has no manifest."""
    commit = _first_commit(root)
    if commit is None:
        raise HarnessError(f"{root}: cannot find the lab's first commit (no branch autolab/master)")
    return _pinned_names(root, commit, _bench_blobs(root, commit))


def _bench_blobs(root: Path, commit: str) -> dict[str, str]:
    """{file name: blob id} of the files directly in `commit`'s bench/: one git call, however
    many files the harness has (the loop pins on every pass)."""
    out = git_bytes(root, "ls-tree", "-z", commit, "bench/")
    blobs = {}
    for entry in out.stdout.decode("utf-8", errors="replace").split("\0"):
        meta, _, path = entry.partition("\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == "blob":
            blobs[path.removeprefix("bench/")] = parts[2]
    return blobs


def _blob(root: Path, blob: str, name: str) -> bytes:
    data = git_bytes(root, "cat-file", "blob", blob).stdout
    if _blob_id(data) != blob:
        raise HarnessError(f"git returned other bytes for bench/{name} ({blob[:12]})")
    return data


def _pinned_names(root: Path, commit: str, blobs: dict[str, str]) -> tuple[str, ...]:
    if MANIFEST not in blobs:
        return LEGACY_HARNESS_FILES  # made before the manifest: see the module docstring
    return (*manifest_files(_blob(root, blobs[MANIFEST], MANIFEST).decode("utf-8")), MANIFEST)


def pinned_harness(root: Path) -> Path:
    """The harness the lab was made with: `.autolab/harness/<commit>/`, written from the git
    blobs of the lab's first commit and checked against them (blob ids) on every call, every
    file of its manifest and the manifest too. Runs on every backend use it, never the lab's
    editable bench/."""
    commit = _first_commit(root)
    if commit is None:
        raise HarnessError(f"{root}: cannot find the lab's first commit (no branch autolab/master)")
    pinned = LabPaths.of(root).state / "harness" / commit[:12]
    blobs = _bench_blobs(root, commit)
    for name in _pinned_names(root, commit, blobs):
        blob = blobs.get(name)
        if blob is None:
            raise HarnessError(f"the lab's first commit {commit[:12]} has no bench/{name}: this "
                               "lab was made by an older autolab; make a new one with `autolab init`")
        path = pinned / name
        if path.is_file() and _blob_id(path.read_bytes()) == blob:
            continue
        data = _blob(root, blob, name)
        pinned.mkdir(parents=True, exist_ok=True)
        atomic_write(path, data.decode("utf-8"))
    return pinned
