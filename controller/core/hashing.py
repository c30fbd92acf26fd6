"""Identities of a candidate: the exact hash and the semantic hash.

`candidate_hash` is the SHA-1 of the surface source after normalising line
endings and trailing whitespace, the identity the seed ledger uses. Two
candidates with that hash equal are the same file for every practical purpose.

`semantic_hash` is the SHA-1 of the Python AST (without line numbers), so a
change that only edits comments, blank lines or formatting hashes the same as
the source it came from. A repeat dressed up that way is still a repeat, and
no GPU is spent on it.
"""

from __future__ import annotations

import ast
import hashlib


def normalise_source(source: str) -> str:
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return text + "\n"


def candidate_hash(source: str) -> str:
    return hashlib.sha1(normalise_source(source).encode("utf-8")).hexdigest()


def semantic_hash(source: str) -> str:
    """Hash of the AST; raises SyntaxError for source that does not parse."""
    tree = ast.parse(source)
    dumped = ast.dump(tree, annotate_fields=True, include_attributes=False)
    return hashlib.sha1(dumped.encode("utf-8")).hexdigest()
