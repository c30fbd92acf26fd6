"""Identities of a candidate: the exact hash and the semantic hash.

`candidate_hash` is the SHA-1 of the surface source after normalising line
endings and trailing whitespace, the identity the seed ledger uses. Two
candidates with that hash equal are the same file for every practical purpose.

`semantic_hash` is the SHA-1 of the Python AST (without line numbers), so a
change that only edits comments, blank lines or formatting hashes the same as
the source it came from. A repeat dressed up that way is still a repeat, and
no GPU is spent on it.

Both hashes name the program only if Python runs the text they were taken
from. The controller compiles and hashes a `str`, and `compile()` of a `str`
ignores a PEP 263 coding declaration, while `python train.py` decodes the file's
bytes by it: `# -*- coding: latin-1 -*-` (or `# vim: set fileencoding=... :`)
would make the program that runs differ from the one that was checked. So
`check_candidate_source` accepts strict UTF-8 only: no declaration of another
encoding in the first two lines, no byte-order mark (the bytes are the
identity; a BOM adds nothing but a second spelling of the same file), no NUL.

Candidates of one master share all but a few of its top-level statements, and
`ast.dump` of a 400-line file costs ~10 ms of pure Python per check. So the dump
of each top-level statement is remembered, keyed by the text of the lines it
spans (with its columns and kind): a statement's AST is a function of its own
tokens, and those lines hold every one of them. The module's dump is the same
string `ast.dump` gives, built from the statements' dumps (a test holds them
equal), so the hash is the one every ledger row and master already carries.

Building the Python tree of the whole file costs more than the dump did (`ast.parse`
of train.py ~6 ms, then `compile()` of that tree ~4 ms, as much as compiling the
text). So a check parses only what changed: the lines between the longest run of
whole statements the candidate shares, line for line, with the start of a module
hashed before and the longest it shares with its end (`_Module`, a few remembered per
process). That middle is parsed on its own. A tokenizer reads the shared lines the
same way whatever follows them, and the middle, parsed alone, starts at column 0 and
ends with nothing open (a bracket, a string, a block waiting for `else:`): so the
whole file's statements are the shared ones around the middle's. A middle that does
not parse alone (an indented line continuing a shared block, say) is not a shortcut:
the whole file is parsed. And it compiles only that middle where the module it starts
from is known to compile (`compiled_semantic_hash`): Python's compiler judges each
top-level statement on its own but for a top-level `global` and `from __future__`,
so a module with either, or a middle that does not compile alone, is compiled whole,
and its error is the one `python` gives.
"""

from __future__ import annotations

import ast
import hashlib
import re
import threading
from collections import OrderedDict
from typing import NamedTuple

# PEP 263, as CPython's tokenizer reads it (a comment line in the first two lines).
CODING_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.ASCII)
UTF8_NAMES = ("utf-8", "utf8")


class SourceRefusal(NamedTuple):
    """Why a candidate's source cannot be run: a CamelCase reason and a message with the fix."""

    reason: str
    message: str


def check_candidate_source(data: bytes, surface: str = "bench/train.py") -> SourceRefusal | None:
    """Refuse source whose bytes Python would read otherwise than the controller does."""
    if data.startswith(b"\xef\xbb\xbf"):
        return SourceRefusal("SourceEncoding",
                             f"{surface} starts with a UTF-8 byte-order mark; only plain UTF-8 "
                             "source is accepted: remove the BOM")
    for number, line in enumerate(re.split(rb"\r\n|\r|\n", data, maxsplit=2)[:2], start=1):
        m = CODING_COOKIE.match(line)
        if m and m.group(1).decode("ascii").lower().replace("_", "-") not in UTF8_NAMES:
            return SourceRefusal("SourceEncoding",
                                 f"{surface} line {number} declares the source encoding "
                                 f"{m.group(1).decode('ascii')!r}; only UTF-8 source is "
                                 "accepted: remove the coding declaration")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return SourceRefusal("SourceEncoding",
                             f"{surface} line {line}: byte 0x{data[e.start]:02X} is not UTF-8; "
                             "only UTF-8 source is accepted: save the file as UTF-8")
    if "\0" in text:
        line = text.count("\n", 0, text.index("\0")) + 1
        return SourceRefusal("CompileError", f"candidate does not compile: {surface} line "
                                             f"{line}: contains a NUL byte; remove it")
    return None


def normalise_source(source: str) -> str:
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return text + "\n"


def candidate_hash(source: str) -> str:
    return hashlib.sha1(normalise_source(source).encode("utf-8")).hexdigest()


# CPython 3.11 keeps the AST constructor's recursion counter per interpreter, not per
# thread (gh-106905): two threads in `ast.parse` at once can fail with "SystemError: AST
# constructor recursion depth mismatch". The operator's handler threads and the local
# loop parse candidates concurrently, so every parse in the controller goes through here.
_AST_LOCK = threading.Lock()


def parse_python(source: str, filename: str = "<unknown>", mode: str = "exec") -> ast.AST:
    """`ast.parse`, one thread at a time (see `_AST_LOCK`); raises SyntaxError like it."""
    with _AST_LOCK:
        return ast.parse(source, filename, mode)


def compile_source(source: str, filename: str) -> None:
    """`compile()` of the text, as `python` runs it; raises SyntaxError like it (and
    RecursionError or MemoryError for what Python's compiler cannot hold either)."""
    compile(source, filename, "exec", dont_inherit=True)


def semantic_hash(source: str) -> str:
    """Hash of the AST of source that compiles (a check compiles it first); SyntaxError
    where the whole file is parsed and does not parse.

    Only the statements that differ from a module hashed before are parsed and dumped
    (see the module's docstring); the hash is sha1(ast.dump(ast.parse(source)))."""
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    found = _Module.shortcut(lines)
    module = found[0] if found is not None else _Module.parsed(source, lines)
    return _remembered_hash(module)


def compiled_semantic_hash(source: str, filename: str) -> str:
    """`compile_source`, then `semantic_hash`: raises what `python` would raise compiling
    the text, and compiles only what changed where that gives the same verdict.

    A module made of a compiled module's statements around a new middle compiles if its
    middle compiles on its own, with two exceptions that reach across statements: a
    top-level `global` (Python refuses one that follows a use or an assignment of the
    name anywhere before it at module level) and `from __future__` (it must come first and
    changes how the rest compiles). Where either module holds one, or there is no such
    module to start from, or the middle alone does not compile, the whole text is
    compiled: its error, with its line, is the one a user sees (the module's docstring
    says why the statements around the middle are the same statements in both)."""
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    found = _Module.shortcut(lines, compiled=True)
    module = None
    if found is not None and not found[1].declares and not _declares(found[2].body):
        try:
            with _AST_LOCK:
                compile(found[2], filename, "exec", dont_inherit=True)
            module = found[0]
        except Exception:  # its own error or not: the whole text says which, and where
            module = None
    if module is None:
        compile_source(source, filename)
        module = _Module.parsed(source, lines)
    if isinstance(module, _Module):
        module.compiled = True
    return _remembered_hash(module)


def _remembered_hash(module: "_Module | str") -> str:
    if isinstance(module, str):  # a tree the statements cannot stand for (see `parsed`)
        return module
    _Module.remember(module)
    return hashlib.sha1(
        f"Module(body=[{', '.join(module.dumps)}], type_ignores=[])".encode("utf-8")).hexdigest()


def _declares(body: list[ast.stmt]) -> bool:
    """A top-level statement that reaches across the module when it compiles."""
    return any(isinstance(node, ast.Global) or (isinstance(node, ast.ImportFrom)
                                                and node.module == "__future__")
               for node in body)


STATEMENT_DUMPS_MAX = 4096  # top-level statements remembered (a few masters' worth)
_STATEMENT_DUMPS: OrderedDict[tuple, str] = OrderedDict()
_STATEMENT_DUMPS_LOCK = threading.Lock()
MODULES_KEPT = 4  # modules a later one is compared with (a master and the candidates of it)


def _statement_dump(node: ast.stmt, text: str) -> str:
    """`ast.dump` of one top-level statement, remembered by its kind, columns and lines."""
    key = (type(node).__name__, node.col_offset, node.end_col_offset, text)
    with _STATEMENT_DUMPS_LOCK:
        dumped = _STATEMENT_DUMPS.get(key)
        if dumped is not None:
            _STATEMENT_DUMPS.move_to_end(key)
            return dumped
    dumped = ast.dump(node, annotate_fields=True, include_attributes=False)
    with _STATEMENT_DUMPS_LOCK:
        _STATEMENT_DUMPS[key] = dumped
        while len(_STATEMENT_DUMPS) > STATEMENT_DUMPS_MAX:
            _STATEMENT_DUMPS.popitem(last=False)
    return dumped


class _Module:
    """A hashed module as lines and units: runs of top-level statements that share no line
    with another run (`a = 1; b = 2` is one unit), each with its first and last line
    (0-based, decorators included) and the dumps of its statements."""

    _kept: list["_Module"] = []
    _lock = threading.Lock()

    def __init__(self, lines: list[str], units: list[tuple[int, int, list[str]]],
                 declares: bool = False):
        self.lines = lines
        self.units = units
        self.declares = declares  # holds a top-level `global` or `from __future__`
        self.compiled = False  # known to compile as a whole (`compiled_semantic_hash`)

    @property
    def dumps(self) -> list[str]:
        return [d for _, _, ds in self.units for d in ds]

    @classmethod
    def of(cls, lines: list[str], body: list[ast.stmt], offset: int) -> "_Module":
        """Units of statements parsed from `lines[offset:]` (line numbers count from there)."""
        units: list[tuple[int, int, list[str]]] = []
        for node in body:
            first = offset + min([node.lineno, *(d.lineno for d in
                                                 getattr(node, "decorator_list", ()))]) - 1
            last = offset + (node.end_lineno or node.lineno) - 1
            dump = _statement_dump(node, "\n".join(lines[first:last + 1]))
            if units and first <= units[-1][1]:  # shares a line with the unit before
                units[-1] = (units[-1][0], max(last, units[-1][1]), units[-1][2] + [dump])
            else:
                units.append((first, last, [dump]))
        return cls(lines, units, _declares(body))

    @classmethod
    def parsed(cls, source: str, lines: list[str]) -> "_Module | str":
        """The whole text parsed (SyntaxError if it does not parse); a module whose tree
        the statements cannot stand for gives its hash instead."""
        tree = parse_python(source)
        if not isinstance(tree, ast.Module) or tree.type_ignores:
            return hashlib.sha1(ast.dump(tree).encode("utf-8")).hexdigest()
        return cls.of(lines, tree.body, 0)

    @classmethod
    def remember(cls, module: "_Module") -> None:
        with cls._lock:
            cls._kept = [module] + [m for m in cls._kept if m is not module][:MODULES_KEPT - 1]

    @classmethod
    def shortcut(cls, lines: list[str], compiled: bool = False
                 ) -> "tuple[_Module, _Module, ast.Module] | None":
        """`lines` as units, parsing only what no kept module holds, with the kept module
        it started from and the middle's tree (`compiled`: only from one known to compile);
        None: parse it all."""
        with cls._lock:
            kept = [m for m in cls._kept if m.compiled or not compiled]
        best: tuple[int, "_Module", int, int] | None = None
        for ref in kept:
            n = min(len(lines), len(ref.lines))
            head = 0
            while head < n and lines[head] == ref.lines[head]:
                head += 1
            tail = 0
            while tail < n - head and lines[-1 - tail] == ref.lines[-1 - tail]:
                tail += 1
            if best is None or head + tail > best[0]:
                best = (head + tail, ref, head, tail)
        if best is None:
            return None
        _, ref, head, tail = best
        before = [u for u in ref.units if u[1] < head]  # whole units within the shared head
        after = [u for u in ref.units if u[0] >= len(ref.lines) - tail]  # ... and tail
        start = before[-1][1] + 1 if before else 0
        shift = len(lines) - len(ref.lines)
        end = (after[0][0] + shift) if after else len(lines)  # the middle: lines[start:end]
        if end < start:
            return None
        try:
            tree = parse_python("\n".join(lines[start:end]))
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None  # not a run of whole statements on its own: parse the file
        if not isinstance(tree, ast.Module) or tree.type_ignores:
            return None
        middle = cls.of(lines, tree.body, start)
        # Declares if the kept module or the middle does (the kept one's may have been in the
        # lines replaced: then a later check compiles whole, which is only slower).
        return cls(lines, before + middle.units + [(f + shift, l + shift, ds)
                                                   for f, l, ds in after],
                   ref.declares or middle.declares), ref, tree
