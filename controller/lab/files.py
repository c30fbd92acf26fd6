"""Files the lab rewrites while others read them: written whole, or not at all.

A reader of `master.json`, a status file or a note never sees half of one: the text goes to a
temporary file beside the target, is flushed to disk, and takes the target's name in one
`os.replace` (atomic on POSIX within a directory). A crash leaves the old file, never a torn one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (its directory is made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary name of its own per call: two threads of one process writing the same file
    # must not share (and steal) one temporary file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
