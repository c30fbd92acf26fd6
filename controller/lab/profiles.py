"""The benchmark's profiles, read from the harness's `prepare.py` without running it.

`bench/prepare.py`'s `PROFILES = {"default": Profile(...), "tiny": Profile(...)}` is the only
definition of a profile's numbers (training budget, start-up and export allowances,
evaluation timeout, ...). The harness runs standalone in a sandbox and cannot import the
controller, so the controller comes to it instead: this module parses the file with `ast` and
takes the keyword constants of the `Profile(...)` calls. Nothing in the file is executed (no
numpy, no environment checks, no `AUTOLAB_BENCH_PROFILE`); a file it cannot read that way is
a `ProfileError` naming the file and the line.

Which file: `profiles()` reads the repository's `bench/` (the one `autolab init` seeds labs
from); `lab_profiles(root)` reads a lab's own pinned harness (its first commit's
`bench/prepare.py`, the one its runs execute; see `controller.lab.harness.pinned_harness`).
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from controller.core.errors import MachineError
from controller.core.hashing import parse_python

REPO_BENCH = Path(__file__).resolve().parents[2] / "bench"
HARNESS_FILE = "prepare.py"
DEFAULT = "default"
# What the controller reads; a profile without one of them is refused when it is read.
NUMBERS = ("time_budget", "startup_allowance", "export_allowance", "eval_timeout")


class ProfileError(MachineError, ValueError):
    """The profiles cannot be read from a harness file (missing, not Python, not literal)."""


@dataclass(frozen=True)
class Profile:
    """One entry of a harness's PROFILES: every keyword of its `Profile(...)` call in `values`,
    each also an attribute (`p.max_seq_len`); the numbers the controller uses as floats."""

    name: str
    values: Mapping[str, Any]
    source: Path = field(compare=False)

    @property
    def time_budget(self) -> float:
        return float(self.values["time_budget"])

    @property
    def startup_allowance(self) -> float:
        return float(self.values["startup_allowance"])

    @property
    def export_allowance(self) -> float:
        return float(self.values["export_allowance"])

    @property
    def eval_timeout(self) -> float:
        return float(self.values["eval_timeout"])

    def __getattr__(self, key: str) -> Any:
        if key.startswith("__") or key in ("name", "values", "source"):
            raise AttributeError(key)
        try:
            return self.values[key]
        except KeyError:
            raise AttributeError(f"profile {self.name!r} ({self.source}) has no {key!r}") from None


def harness_path(bench_dir: str | Path | None = None) -> Path:
    return Path(bench_dir if bench_dir is not None else REPO_BENCH) / HARNESS_FILE


def profiles(bench_dir: str | Path | None = None) -> dict[str, Profile]:
    """The profiles of `bench_dir/prepare.py` (default: the repository's bench/), by name."""
    return read_profiles(harness_path(bench_dir))


def profile(name: str, bench_dir: str | Path | None = None) -> Profile:
    return _pick(profiles(bench_dir), name)


def lab_harness(root: str | Path, harness: str | None = None) -> Path:
    """The prepare.py whose profiles a lab's runs use: the lab's pinned harness (its first
    commit's bench/prepare.py); for a directory that has none (not a lab's git repository, or
    a lab made by an older autolab), the lab's `harness` file (lab.yaml's spec.harness,
    default bench/prepare.py) if it exists, else the repository's."""
    from controller.lab.harness import HarnessError, pinned_harness  # git; only when asked

    root = Path(root)
    try:
        return pinned_harness(root) / HARNESS_FILE
    except (HarnessError, OSError):
        pass
    own = root / (harness or f"bench/{HARNESS_FILE}")
    return own if own.is_file() else harness_path()


def lab_profiles(root: str | Path, harness: str | None = None) -> dict[str, Profile]:
    return read_profiles(lab_harness(root, harness))


def lab_profile(root: str | Path, name: str, harness: str | None = None) -> Profile:
    return _pick(lab_profiles(root, harness), name)


def _pick(found: dict[str, Profile], name: str) -> Profile:
    try:
        return found[name]
    except KeyError:
        source = next(iter(found.values())).source
        raise ProfileError(f"{source}: no profile {name!r}; it defines {sorted(found)}") from None


# --- reading the file ----------------------------------------------------------------------------

_cache: dict[Path, tuple[tuple[int, int, int], dict[str, Profile]]] = {}


def read_profiles(path: str | Path) -> dict[str, Profile]:
    """Every profile `path` (a prepare.py) defines, parsed, never executed."""
    path = Path(path)
    try:
        st = path.stat()
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        hit = _cache.get(path)
        if hit is not None and hit[0] == key:
            return dict(hit[1])
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ProfileError(f"{path}: cannot read the benchmark's profiles: "
                           f"{getattr(e, 'strerror', None) or e}") from None
    found = parse_profiles(text, path)
    _cache[path] = (key, found)
    return dict(found)


def parse_profiles(text: str, path: str | Path = "<prepare.py>") -> dict[str, Profile]:
    """The `PROFILES = {name: Profile(keyword=constant, ...)}` of a prepare.py's source."""
    path = Path(path)
    try:
        tree = parse_python(text, filename=str(path))
    except SyntaxError as e:
        raise ProfileError(f"{path}:{e.lineno}: not Python ({e.msg}); cannot read its profiles") \
            from None

    def fail(node: ast.AST | None, why: str) -> ProfileError:
        line = getattr(node, "lineno", None)
        return ProfileError(f"{path}{f':{line}' if line else ''}: {why}")

    fields: list[str] | None = None  # the Profile class's fields, in order (positional arguments)
    table: ast.expr | None = None
    for stmt in tree.body:
        if isinstance(stmt, ast.ClassDef) and stmt.name == "Profile":
            fields = [s.target.id for s in stmt.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
        elif isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "PROFILES" for t in stmt.targets):
            table = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                and stmt.target.id == "PROFILES" and stmt.value is not None:
            table = stmt.value
    if table is None:
        raise fail(None, "no module-level `PROFILES = {...}`; cannot read the benchmark's profiles")
    if not isinstance(table, ast.Dict) or not table.keys:
        raise fail(table, "PROFILES is not a non-empty dict literal of Profile(...) calls")

    out: dict[str, Profile] = {}
    for k, v in zip(table.keys, table.values):
        if not (isinstance(k, ast.Constant) and isinstance(k.value, str)):
            raise fail(k if k is not None else v, "a PROFILES key is not a string literal")
        name = k.value
        func = v.func if isinstance(v, ast.Call) else None
        if not ((isinstance(func, ast.Name) and func.id == "Profile")
                or (isinstance(func, ast.Attribute) and func.attr == "Profile")):
            raise fail(v, f"PROFILES[{name!r}] is not a Profile(...) call")
        values: dict[str, Any] = {}
        if v.args:
            if fields is None or len(v.args) > len(fields) \
                    or any(isinstance(a, ast.Starred) for a in v.args):
                raise fail(v, f"PROFILES[{name!r}]: positional arguments that cannot be matched "
                              "to the Profile class's fields; use keywords")
            for f, a in zip(fields, v.args):
                values[f] = _constant(a, fail, f"PROFILES[{name!r}].{f}")
        for kw in v.keywords:
            if kw.arg is None:
                raise fail(kw.value, f"PROFILES[{name!r}]: **arguments cannot be read without "
                                     "running the file; use keywords")
            values[kw.arg] = _constant(kw.value, fail, f"PROFILES[{name!r}].{kw.arg}")
        for n in NUMBERS:
            x = values.get(n)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) \
                    or x < 0:
                raise fail(v, f"PROFILES[{name!r}] has no {n} (a non-negative number)"
                              if n not in values else
                              f"PROFILES[{name!r}].{n} = {x!r} is not a non-negative number")
        out[name] = Profile(name=str(values.get("name", name)), values=MappingProxyType(values),
                            source=path)
    return out


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _constant(node: ast.expr, fail, where: str) -> Any:
    """A literal, or arithmetic on numeric literals (`20 * 2**19`, `2_000_000`, `-1.5`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        x = _constant(node.operand, fail, where)
        if _number(x):
            return _UNARY[type(node.op)](x)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _constant(node.left, fail, where), _constant(node.right, fail, where)
        if _number(a) and _number(b) and not (isinstance(node.op, ast.Pow) and abs(b) > 256):
            try:
                return _BINARY[type(node.op)](a, b)
            except (ArithmeticError, ValueError):
                pass
    raise fail(node, f"{where} = {ast.unparse(node)} is not a constant; the controller reads the "
                     "profiles without running the file, so write numbers (arithmetic on number "
                     "literals is fine)")
