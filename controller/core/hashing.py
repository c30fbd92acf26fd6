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


def compile_tree(tree: ast.AST, filename: str) -> None:
    """`compile()` of a parsed module, as the check runs it; raises SyntaxError like it.

    Under `_AST_LOCK` too: turning the tree back into the compiler's own is the other half
    of the AST code that keeps that counter."""
    with _AST_LOCK:
        compile(tree, filename, "exec", dont_inherit=True)


def semantic_hash(source: str, tree: ast.AST | None = None) -> str:
    """Hash of the AST; raises SyntaxError for source that does not parse.

    `tree` is `parse_python(source)` where the caller parsed it already (a check compiles
    the same tree it hashes)."""
    if tree is None:
        tree = parse_python(source)
    return hashlib.sha1(_dump_module(source, tree).encode("utf-8")).hexdigest()


STATEMENT_DUMPS_MAX = 4096  # top-level statements remembered (a few masters' worth)
_STATEMENT_DUMPS: OrderedDict[tuple, str] = OrderedDict()
_STATEMENT_DUMPS_LOCK = threading.Lock()


def _dump_module(source: str, tree: ast.AST) -> str:
    """`ast.dump(tree)` (fields named, no positions), each top-level statement's part memoised."""
    if not isinstance(tree, ast.Module) or tree.type_ignores:
        return ast.dump(tree, annotate_fields=True, include_attributes=False)
    # Line numbers count lines as the tokenizer does, after it made every line end a LF.
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    parts = []
    for node in tree.body:
        first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
        key = (type(node).__name__, node.col_offset, node.end_col_offset,
               "\n".join(lines[first - 1:node.end_lineno]))
        with _STATEMENT_DUMPS_LOCK:
            dumped = _STATEMENT_DUMPS.get(key)
            if dumped is not None:
                _STATEMENT_DUMPS.move_to_end(key)
        if dumped is None:
            dumped = ast.dump(node, annotate_fields=True, include_attributes=False)
            with _STATEMENT_DUMPS_LOCK:
                _STATEMENT_DUMPS[key] = dumped
                while len(_STATEMENT_DUMPS) > STATEMENT_DUMPS_MAX:
                    _STATEMENT_DUMPS.popitem(last=False)
        parts.append(dumped)
    return f"Module(body=[{', '.join(parts)}], type_ignores=[])"
