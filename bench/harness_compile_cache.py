"""The compile cache of the lab's starting program.

The compile cache (`--compile-cache-from SHA1`, phase all). Compiling is most
of a candidate's start-up, and most candidates compile the same graphs as the
lab's starting program. Every run compiles into a cache of its own in its
scratch; a cache shared between candidates would be a place for one to leave
code or trained weights for the next. So only one program's cache is kept:
the lab's starting train.py, whose sha1 the controller passes (its owner's
code, not an agent's). The first run of exactly those bytes that trains by the
rules keeps its cache under `<data cache>/compile-seeds/<profile>/<sha1>/`
(out of every candidate's reach); every later run starts with a copy of it in
its own scratch, which it may change as it likes and which goes with it. A run
of any other bytes never writes there, so what a candidate finds in its cache
is what the starting program compiled, whoever ran before it.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import prepare  # the trusted one, next to this file
from harness_common import RunLog


# The compile cache of the lab's starting program (its owner's train.py, not an agent's): kept
# under <data cache>/COMPILE_SEEDS/<profile>/<sha1>/{compile,triton} by the first run of exactly
# those bytes (or by the harness's warm-up of them, --starting-program), and copied into every run's
# scratch before its candidate starts. Only a run of those bytes ever writes there, so no candidate
# can leave anything in it for another run; each candidate gets a copy of its own. An empty entry: a
# warm-up that compiled nothing (a CPU machine), so no later run warms up again. Bounded: a cache
# larger than this is neither kept nor copied.
COMPILE_SEEDS = "compile-seeds"
CACHE_DIRS = ("compile", "triton")  # $TORCHINDUCTOR_CACHE_DIR and $TRITON_CACHE_DIR in the scratch
SEED_CACHE_LIMIT_BYTES = {"tiny": 64 * 2**20, "default": 2 * 2**30}
SEED_CACHE_MAX_FILES = 20_000


class _TooBig(Exception):
    pass


def _copy_tree(src: Path, dst: Path, limit: int, max_files: int) -> tuple[int, int]:
    """Copy the directories and regular files under src into dst, never through a link (links,
    FIFOs and devices are left out); (files, bytes). _TooBig past max_files files or limit bytes."""
    files = size = 0

    def walk(src_fd: int, to: Path, depth: int) -> None:
        nonlocal files, size
        to.mkdir(mode=0o700, exist_ok=True)
        with os.scandir(src_fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False), e.is_file(follow_symlinks=False)) for e in it]
        for name, is_dir, is_file in entries:
            if is_dir and depth < 32:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
                try:
                    walk(fd, to / name, depth + 1)
                finally:
                    os.close(fd)
            elif is_file:
                fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_fd)
                with os.fdopen(fd, "rb") as f:
                    st = os.fstat(f.fileno())
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    files, size = files + 1, size + st.st_size
                    if files > max_files or size > limit:
                        raise _TooBig(f"more than {max_files} files or {limit} bytes")
                    with open(to / name, "wb") as out:
                        shutil.copyfileobj(f, out, 2**22)
                    os.chmod(to / name, stat.S_IMODE(st.st_mode) & 0o755 | 0o600)

    top = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        walk(top, dst, 0)
    finally:
        os.close(top)
    return files, size


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)
    for root, dirs, names in os.walk(path):
        for n in dirs + names:
            os.chown(os.path.join(root, n), uid, uid, follow_symlinks=False)


def seed_cache_entry(sha1: str) -> Path:
    """Where the compile cache of the program with this sha1 is kept (see COMPILE_SEEDS)."""
    return prepare.cache_root() / COMPILE_SEEDS / prepare.PROFILE / sha1


def _seed_compile_cache(sha1: str | None, scratch: Path, log: RunLog, result: dict[str, Any]) -> None:
    """Copy the kept compile cache of the lab's starting program (if any) into the scratch."""
    if not sha1:
        return
    entry = seed_cache_entry(sha1)
    info: dict[str, Any] = result.setdefault("compile_cache", {})  # a warm-up may have said how it went
    info.update(program=sha1[:12], seeded=False, kept=False)
    if not entry.is_dir():
        log.harness(f"no compile cache of the starting program {sha1[:12]} yet: the candidate compiles from cold")
        return
    began = time.monotonic()
    files = size = 0
    try:
        for name in CACHE_DIRS:
            if (entry / name).is_dir():
                n, b = _copy_tree(entry / name, scratch / name, SEED_CACHE_LIMIT_BYTES.get(prepare.PROFILE, 2**30),
                                  SEED_CACHE_MAX_FILES)
                files, size = files + n, size + b
    except (OSError, _TooBig) as e:  # a cold compile, not a failed run
        for name in CACHE_DIRS:
            shutil.rmtree(scratch / name, ignore_errors=True)
        log.harness(f"the compile cache of {sha1[:12]} could not be copied ({e}): the candidate compiles from cold")
        return
    if not files:  # kept by a warm-up that compiled nothing (see _warm_compile_cache)
        log.harness(f"the starting program {sha1[:12]} compiled nothing here: there is no cache to start from")
        return
    info.update(seeded=True, files=files, bytes=size, seconds=round(time.monotonic() - began, 2))
    log.harness(f"the candidate starts with a copy of the compile cache of the starting program {sha1[:12]} "
                f"({files} files, {size / 2**20:.1f} MiB, {info['seconds']:.2f}s)")


def _keep_compile_cache(sha1: str | None, scratch: Path, log: RunLog, result: dict[str, Any]) -> None:
    """After a run of exactly the starting program's bytes: keep its compile cache for later runs
    (once; the first run to finish wins)."""
    if not sha1 or result.get("candidate_sha1") != sha1:
        return
    entry = seed_cache_entry(sha1)
    if entry.exists() or not any((scratch / n).is_dir() for n in CACHE_DIRS):
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{sha1[:12]}-", dir=entry.parent))
    try:
        files = size = 0
        for name in CACHE_DIRS:
            if (scratch / name).is_dir():
                n, b = _copy_tree(scratch / name, tmp / name, SEED_CACHE_LIMIT_BYTES.get(prepare.PROFILE, 2**30),
                                  SEED_CACHE_MAX_FILES)
                files, size = files + n, size + b
        os.rename(tmp, entry)
    except (OSError, _TooBig) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not entry.exists():
            log.harness(f"the compile cache of the starting program was not kept ({e})")
        return
    result.setdefault("compile_cache", {})["kept"] = True
    log.harness(f"kept the compile cache of the starting program {sha1[:12]} for later runs "
                f"({files} files, {size / 2**20:.1f} MiB)")
