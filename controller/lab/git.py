"""Git plumbing: how the lab talks to git, and nothing about what it says.

Every git command the lab runs commits as `autolab` with no signing and no hooks (`GIT_ID`),
takes its arguments as a list (no shell ever sees a user's string) and raises `GitError`
with git's own words when it fails.

A pre-run check would start several processes (read a blob, write a blob, make trees, write a
commit, move a branch); `Plumbing` keeps one long-lived process for each instead (`cat-file
--batch`, `hash-object --stdin-paths`, `mktree --batch`, `update-ref --stdin`), each answering
a request a line, so a check starts only `git apply` (issue 15: `git worktree add`/`remove`
alone took ~30 ms). A process that failed has ended; `Plumbing.alive` then says so and its
owner starts them all anew.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
import time
import weakref
from pathlib import Path

from controller.core.errors import MachineError

GIT_NAME, GIT_EMAIL = "autolab", "autolab@localhost"  # who commits in a lab
GIT_ID = ["-c", f"user.name={GIT_NAME}", "-c", f"user.email={GIT_EMAIL}",
          "-c", "commit.gpgsign=false", "-c", "core.hooksPath=/dev/null"]
TREE_KINDS = {b"40000": b"tree", b"160000": b"commit"}  # a tree entry's mode -> its object's kind


class GitError(MachineError, RuntimeError):
    """A git command failed; the message is the command and what git said."""


def run_git(root: Path, *args: str, cwd: Path | None = None, input: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
    """`git` as the lab runs it, text in and out."""
    proc = subprocess.run(["git", *GIT_ID, *args], cwd=cwd or root, input=input,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise GitError(f"git {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def run_git_bytes(root: Path, *args: str, input: bytes | None = None, env: dict | None = None,
                  check: bool = True) -> subprocess.CompletedProcess:
    """`git` with bytes in and out (a candidate's exact bytes; a temporary index)."""
    proc = subprocess.run(["git", *GIT_ID, *args], cwd=root, input=input,
                          capture_output=True, env=env)
    if check and proc.returncode != 0:
        why = (proc.stderr or proc.stdout).decode("utf-8", "replace").strip()
        raise GitError(f"git {' '.join(args)}: {why}")
    return proc


def apply_env(scratch: str) -> dict[str, str]:
    """`git apply` in a scratch directory: never a repository above it, nobody's config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return {**env, "GIT_CEILING_DIRECTORIES": scratch, "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull}


def tree_entries(raw: bytes, id_bytes: int) -> list[tuple[bytes, bytes, str]]:
    """A tree object's entries as (mode, name, object id), in git's order."""
    entries, i = [], 0
    while i < len(raw):
        space = raw.index(b" ", i)
        nul = raw.index(b"\0", space)
        entries.append((raw[i:space], raw[space + 1:nul], raw[nul + 1:nul + 1 + id_bytes].hex()))
        i = nul + 1 + id_bytes
    return entries


def mktree_line(mode: bytes, name: bytes, oid: str) -> bytes:
    """One entry of `git mktree -z` input."""
    return mode + b" " + TREE_KINDS.get(mode, b"blob") + b" " + oid.encode() + b"\t" + name + b"\0"


def commit_object(tree: str, parent: str, message: str) -> bytes:
    """The bytes of a commit as `git commit-tree` writes it for the lab (author and committer
    autolab, now, in the local zone; the message as `git commit -m` stores it)."""
    now = time.time()
    offset = int(time.localtime(now).tm_gmtoff) // 60
    when = f"{int(now)} {'-' if offset < 0 else '+'}{abs(offset) // 60:02d}{abs(offset) % 60:02d}"
    who = f"{GIT_NAME} <{GIT_EMAIL}> {when}"
    text = f"tree {tree}\nparent {parent}\nauthor {who}\ncommitter {who}\n\n"
    return text.encode("utf-8") + stripspace(message).encode("utf-8")


def stripspace(message: str) -> str:
    """What `git commit -m` stores (`git stripspace`): trailing whitespace off every line,
    runs of blank lines made one, none at either end, a newline at the end."""
    out: list[str] = []
    for line in message.split("\n"):
        line = line.rstrip(" \t\n\r")  # git's isspace(): not \v or \f
        if line or (out and out[-1]):
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n" if out else ""


class GitPipe:
    """A long-lived git command that answers each request with one line: an object without a
    process each (`hash-object --stdin-paths`, `mktree --batch`). One that failed has ended;
    `Plumbing.alive` then says so, and the next check starts them all anew."""

    def __init__(self, root: Path, *args: str):
        self.args = args
        self.proc = subprocess.Popen(["git", *GIT_ID, *args], cwd=root, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lock = threading.Lock()

    def ask(self, request: bytes) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(request)
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except OSError:
                line = b""
            if not line:  # git said why on stderr, then ended
                assert self.proc.stderr is not None
                with contextlib.suppress(OSError, ValueError):
                    self.proc.stdin.close()
                why = self.proc.stderr.read().decode("utf-8", "replace").strip()
                raise GitError(f"git {' '.join(self.args)}: {why or 'ended'}")
            return line.decode().strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # each of them ends at the end of its input
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for f in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()


class _Reader(GitPipe):
    """`git cat-file --batch`: any object by name, its id and its bytes."""

    def __init__(self, root: Path):
        super().__init__(root, "cat-file", "--batch")

    def object(self, what: str) -> tuple[str, bytes, bytes]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(what.encode("utf-8") + b"\n")
                self.proc.stdin.flush()
                header = self.proc.stdout.readline().split()
            except OSError:
                header = []
            if len(header) != 3:  # "<name> missing", or cat-file ended
                raise GitError(f"git cat-file {what}: {b' '.join(header).decode() or 'ended'}")
            data = self.proc.stdout.read(int(header[2]))
            self.proc.stdout.read(1)  # the newline after the object
            return header[0].decode(), header[1], data


class _RefWriter(GitPipe):
    """`git update-ref --stdin`: a transaction per branch moved."""

    def __init__(self, root: Path):
        super().__init__(root, "update-ref", "--stdin")

    def point(self, ref: str, commit: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(f"start\nupdate {ref} {commit}\ncommit\n".encode())
                self.proc.stdin.flush()
                said = [self.proc.stdout.readline(), self.proc.stdout.readline()]
            except OSError:
                said = []
            if said != [b"start: ok\n", b"commit: ok\n"]:
                why = b"".join(said).decode("utf-8", "replace")
                if self.proc.poll() is not None or not said:  # git said why, then ended
                    assert self.proc.stderr is not None
                    why += self.proc.stderr.read().decode("utf-8", "replace")
                raise GitError(f"git update-ref {ref} {commit}: {why.strip()}")


class Plumbing:
    """The git processes a check talks to instead of starting its own: it reads objects,
    writes blobs, trees and commits, and moves branches, each through one long-lived
    process, so a check starts one process (`git apply`) where it started three."""

    def __init__(self, root: Path):
        self.reader = _Reader(root)
        self.blobs = GitPipe(root, "hash-object", "-w", "--no-filters", "--stdin-paths")
        self.trees = GitPipe(root, "mktree", "-z", "--batch")
        self.commits = GitPipe(root, "hash-object", "-w", "-t", "commit", "--stdin-paths")
        self.refs = _RefWriter(root)
        self._all = (self.reader, self.blobs, self.trees, self.commits, self.refs)
        self._closer = weakref.finalize(self, _close_all, self._all)

    def object(self, what: str) -> tuple[str, bytes, bytes]:
        return self.reader.object(what)

    def read(self, what: str, kind: bytes) -> bytes:
        oid, got, data = self.reader.object(what)
        if got != kind:
            raise GitError(f"git cat-file {what}: a {got.decode()}, not a {kind.decode()}")
        return data

    def alive(self) -> bool:
        return all(p.alive() for p in self._all)

    def close(self) -> None:
        self._closer()


def _close_all(pipes: tuple[GitPipe, ...]) -> None:
    for pipe in pipes:
        pipe.close()
