"""Reading an experiment's diff and deciding whether it may be applied at all.

An experiment may change exactly one file, the lab's surface. Users and agents
name it either relative to the lab root (`bench/train.py`) or by its file name
(`train.py`), with or without git's `a/` `b/` prefixes. Everything else is
refused here, before git sees the text: other files, renames and copies, new
or deleted files, mode changes, binary patches, `..` or absolute paths, and
text that is not a unified diff, and characters a diff may not carry (NUL
and other control characters, lone surrogates, a CR outside a CRLF line end,
bidirectional controls: see `controller.core.spec`). What passes is rewritten
into one canonical diff against the surface's lab-relative path, with LF line
ends, which git then applies to a copy of the surface (see `controller.lab.checks`): the
hunks themselves are git's to judge. A hunk with no context lines (`@@ -60 +60 @@`,
as `diff -U0` writes and people write by hand) is well-formed; git applies it only
when told so (`--unidiff-zero`), so the checked diff says whether it has one.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from controller.core.errors import InputError
from controller.core.hashing import parse_python
from controller.core.spec import unsafe_character

HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class DiffRefused(InputError, ValueError):
    """The diff cannot be used; `reason` is a CamelCase code, the message says what to fix."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _clean_path(raw: str) -> str:
    path = raw.split("\t", 1)[0].strip()
    if path.startswith('"') and path.endswith('"'):
        path = path[1:-1]
    return path


def _strip_prefix(path: str) -> str:
    if path.startswith(("a/", "b/")):
        return path[2:]
    return path


def _check_path(path: str, surface: str) -> None:
    if path == "/dev/null":
        raise DiffRefused("DiffCreatesOrDeletes",
                          f"diff creates or deletes a file; only {surface} may be edited in place")
    if path.startswith("/") or ".." in path.split("/"):
        raise DiffRefused("DiffUnsafePath",
                          f"diff names the path {path!r}; use {surface} or "
                          f"{posixpath.basename(surface)}, never absolute paths or '..'")
    plain = _strip_prefix(path)
    if plain not in (surface, posixpath.basename(surface)) and path not in (
            surface, posixpath.basename(surface)):
        raise DiffRefused("DiffTouchesOtherFile",
                          f"diff touches {plain}; only {surface} may change")


@dataclass(frozen=True)
class SurfaceDiff:
    """A checked diff, rewritten to name the surface by its lab-relative path."""

    text: str
    added: tuple[str, ...]
    removed: tuple[str, ...]
    zero_context: bool = False  # some hunk has no context lines: git needs --unidiff-zero


def parse_surface_diff(text: str, surface: str = "bench/train.py") -> SurfaceDiff:
    """Check that `text` is a unified diff of the surface alone; return it in canonical form."""
    if not text or not text.strip():
        raise DiffRefused("DiffEmpty", "diff is empty; write a unified diff of "
                                       f"{surface} (e.g. `git diff` or `diff -u`)")
    bad = unsafe_character(text, "diff")
    if bad:
        raise DiffRefused("DiffUnsafeCharacter", f"diff {bad}")
    lines = text.replace("\r\n", "\n").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    files: list[tuple[str, str]] = []
    hunks: list[str] = []
    added: list[str] = []
    removed: list[str] = []
    zero_context = False
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        if line.startswith("diff --git "):
            i += 1
            continue
        if line.startswith(("rename from", "rename to", "copy from", "copy to",
                            "similarity index")):
            raise DiffRefused("DiffRenames", f"diff renames or copies a file ({line.strip()}); "
                                             f"only edits to {surface} are allowed")
        if line.startswith(("new file mode", "deleted file mode")):
            raise DiffRefused("DiffCreatesOrDeletes", f"diff creates or deletes a file "
                                                      f"({line.strip()}); only {surface} may "
                                                      "be edited in place")
        if line.startswith(("old mode", "new mode")):
            raise DiffRefused("DiffModeChange", f"diff changes a file mode ({line.strip()}); "
                                                "only the text of the surface may change")
        if line.startswith("GIT binary patch") or (line.startswith("Binary files")
                                                   and line.rstrip().endswith("differ")):
            raise DiffRefused("DiffBinary", "diff contains a binary patch; only text edits to "
                                            f"{surface} are allowed")
        if line.startswith("index ") or line.startswith("Index: ") or line.startswith("==="):
            i += 1
            continue
        if line.startswith("--- "):
            if i + 1 >= n or not lines[i + 1].startswith("+++ "):
                raise DiffRefused("DiffMalformed", f"line {i + 1}: '---' header without a "
                                                   "'+++' line after it")
            old, new = _clean_path(line[4:]), _clean_path(lines[i + 1][4:])
            _check_path(old, surface)
            _check_path(new, surface)
            files.append((old, new))
            i += 2
            continue
        m = HUNK.match(line)
        if m:
            if not files:
                raise DiffRefused("DiffMalformed", f"line {i + 1}: hunk before any "
                                                   "'--- a/…' / '+++ b/…' file header")
            old_len = int(m.group(2)) if m.group(2) is not None else 1
            new_len = int(m.group(4)) if m.group(4) is not None else 1
            body = [line]
            i += 1
            seen_old = seen_new = context = 0
            while i < n and (seen_old < old_len or seen_new < new_len):
                h = lines[i]
                tag = h[:1]
                if h.startswith("\\"):
                    # `\ No newline at end of file` ends the side of the line before it:
                    # git applies it by dropping that line's newline, which anywhere else
                    # joins it to the next line (the diff would read otherwise than the
                    # program git makes of it).
                    prev = body[-1][:1] if len(body) > 1 else ""
                    if prev not in (" ", "-", "+") or (prev in " -" and seen_old < old_len) \
                            or (prev in " +" and seen_new < new_len):
                        raise DiffRefused("DiffMalformed",
                                          f"line {i + 1}: '\\ No newline at end of file' in the "
                                          "middle of a hunk; it may only follow the last line "
                                          "of the file")
                    body.append(h)
                elif tag == " " or h == "":
                    seen_old += 1
                    seen_new += 1
                    context += 1
                    body.append(h if h else " ")
                elif tag == "-":
                    seen_old += 1
                    removed.append(h[1:])
                    body.append(h)
                elif tag == "+":
                    seen_new += 1
                    added.append(h[1:])
                    body.append(h)
                else:
                    raise DiffRefused("DiffMalformed",
                                      f"line {i + 1}: hunk ends early (expected {old_len} old "
                                      f"and {new_len} new lines, got {seen_old} and {seen_new})")
                i += 1
            if seen_old != old_len or seen_new != new_len:
                raise DiffRefused("DiffMalformed", f"hunk '{line}' is truncated: expected "
                                                   f"{old_len} old and {new_len} new lines")
            while i < n and lines[i].startswith("\\"):
                body.append(lines[i])
                i += 1
            zero_context = zero_context or context == 0
            hunks.append("\n".join(body))
            continue
        if not files and not hunks:
            i += 1  # free text before the first header, as `git format-patch` writes
            continue
        if line.strip() == "":
            i += 1
            continue
        raise DiffRefused("DiffMalformed", f"line {i + 1}: unexpected text {line[:60]!r} "
                                           "outside a hunk")
    if not files:
        raise DiffRefused("DiffMalformed", "no '--- a/train.py' / '+++ b/train.py' header found; "
                                           "write a unified diff of the surface")
    if len(files) > 1:
        raise DiffRefused("DiffTouchesOtherFile", "diff has more than one file section; "
                                                  f"only {surface} may change, once")
    if not hunks:
        raise DiffRefused("DiffEmpty", "diff has a header but no hunks; nothing would change")
    canonical = f"--- a/{surface}\n+++ b/{surface}\n" + "\n".join(hunks) + "\n"
    return SurfaceDiff(canonical, tuple(added), tuple(removed), zero_context)


# --- what a change does to the constants ---------------------------------------------------------

_ASSIGN = re.compile(r"^\s*([A-Z][A-Z0-9_]*)\s*=\s*([^#]+?)\s*(#.*)?$")


def _number(expr: str) -> float | None:
    """The value of a constant expression made of numbers and + - * / ** only; else None."""
    import ast

    try:
        node = parse_python(expr, mode="eval").body  # type: ignore[attr-defined]
    except SyntaxError:
        return None

    def value(n: ast.AST) -> float:
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) \
                and not isinstance(n.value, bool):
            return float(n.value)
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.USub, ast.UAdd)):
            v = value(n.operand)
            return -v if isinstance(n.op, ast.USub) else v
        if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub, ast.Mult, ast.Div,
                                                          ast.Pow)):
            a, b = value(n.left), value(n.right)
            if isinstance(n.op, ast.Pow) and abs(b) > 64:
                raise ValueError("too large")
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b,
                    ast.Div: a / b if b else float("nan"), ast.Pow: a ** b}[type(n.op)]
        raise ValueError("not a number")

    try:
        return value(node)
    except (ValueError, OverflowError, ZeroDivisionError):
        return None


def constant_changes(diff: SurfaceDiff) -> dict[str, str]:
    """The UPPER_CASE constants a diff reassigns, and which way: up, down or changed.

    `LR = 0.02` -> `LR = 0.04` is {"LR": "up"}; a value that is not a plain number (a tuple,
    a name) is "changed". Lines the diff only adds or only removes are not counted.
    """
    def assigned(lines: tuple[str, ...]) -> dict[str, str]:
        out = {}
        for ln in lines:
            m = _ASSIGN.match(ln)
            if m:
                out[m.group(1)] = m.group(2)
        return out

    old, new = assigned(diff.removed), assigned(diff.added)
    changes = {}
    for name in old.keys() & new.keys():
        a, b = _number(old[name]), _number(new[name])
        if a is not None and b is not None and a == a and b == b:
            if a != b:
                changes[name] = "up" if b > a else "down"
        elif old[name].strip() != new[name].strip():
            changes[name] = "changed"
    return changes
