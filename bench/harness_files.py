"""Files the candidate could have touched: regular files only, never through a link.

Everything the harness reads back from a candidate's scratch (its export, stats.json, the step
curve) or from a path a caller gave (the key file, the train phase's record) goes through
`_open_regular`: no symbolic link, no FIFO or device (they would block or redirect the read),
and never more than a stated number of bytes. What it reads as JSON is checked for shape
(`_json_object`, `_curve`, `_number`), never trusted.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any


def _open_regular(path: str | os.PathLike, limit: int, base: Path | None = None,
                  follow: bool = False) -> int | None:
    """A read-only fd of path if it is a regular file of at most limit bytes, else None.

    With base, path is relative to it and no component may be a symbolic link (the candidate
    may have replaced a directory of its scratch with one); without, the last component may
    not be one unless `follow` (paths the controller gave: a Kubernetes ConfigMap or Secret
    volume's files are links). FIFOs and devices are refused without blocking on them.
    """
    leaf_flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow and base is None else os.O_NOFOLLOW)
    dir_flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    dir_fd = None
    try:
        if base is None:
            fd = os.open(path, leaf_flags)
        else:
            parts = Path(path).parts
            if not parts or Path(path).is_absolute() or ".." in parts:
                return None
            dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            for part in parts[:-1]:
                nxt = os.open(part, dir_flags, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = nxt
            fd = os.open(parts[-1], leaf_flags, dir_fd=dir_fd)
    except OSError:
        return None
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
        os.close(fd)
        return None
    return fd


def _regular_file(path: str | os.PathLike, limit: int, base: Path | None = None,
                  follow: bool = False) -> bytes | None:
    """The bytes of path if it is a regular file (no symlink) of at most limit bytes."""
    fd = _open_regular(path, limit, base, follow)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as f:
        return f.read(limit + 1)[:limit]


def _copy_regular(src: str | os.PathLike, dst: Path, limit: int, base: Path | None = None) -> bool:
    """Copy src (a regular file, not a link, at most limit bytes) to dst; False if it is not one."""
    fd = _open_regular(src, limit, base)
    if fd is None:
        return False
    with os.fdopen(fd, "rb") as f, open(dst, "wb") as out:
        copied = 0
        while copied <= limit:
            chunk = f.read(2**22)
            if not chunk:
                break
            out.write(chunk)
            copied += len(chunk)
    return copied <= limit


def _curve(raw: bytes | None) -> list[dict]:
    """The candidate's step curve, kept only as well-formed numbers (it is informational)."""
    lines = []
    for text in (raw or b"").decode("utf-8", errors="replace").splitlines():
        try:
            d = json.loads(text)
        except (ValueError, RecursionError):  # RecursionError: arrays nested thousands deep
            continue
        if isinstance(d, dict) and all(_number(d.get(k)) is not None for k in ("step", "loss", "tokens_per_sec")):
            lines.append({k: d[k] for k in ("step", "loss", "tokens_per_sec", "time")
                          if k in d and _number(d[k]) is not None})
    return lines


def _json_object(raw: bytes | None) -> dict:
    """A JSON object the candidate may have written, else {}: never raises (json.loads raises
    RecursionError, not ValueError, for arrays nested thousands deep)."""
    try:
        obj = json.loads(raw) if raw else {}
    except (ValueError, RecursionError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _number(value: Any) -> float | None:
    """value if it is a finite number (an int too large for a float is not: math.isfinite
    raises OverflowError on one, and the candidate writes the numbers this reads)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return value if math.isfinite(value) else None
    except OverflowError:
        return None
