"""`autolab init DIR --from SEED_DIR`: adopt a lab kept in the seed's layout.

The seed lab (scripts, worktrees, a TSV ledger) keeps its state in plain files.
These are the ones read, and what happens when one is missing or malformed:

    SEED/train.py                required. It becomes the master's bench/train.py as
                                 it is. Refused if it is not UTF-8 text Python compiles,
                                 or if it imports from `prepare` a name Autolab's
                                 bench/prepare.py does not define (it will run under
                                 Autolab's harness, not the seed's).
    SEED/research/results.tsv    optional (no rows imported without it). Its header must
                                 begin with the seed's 17 columns in their order; later
                                 columns that Autolab's ledger knows are kept, others are
                                 dropped. A row with more fields than the header is refused
                                 (with its line number); missing trailing fields are empty.
                                 Every row is kept, in order, marked reason `Imported`; a
                                 run id seen twice keeps its first row. Its figures are
                                 marked as the candidate's word (column self_reported):
                                 the seed's train.py measured them, val_bpb included.
    SEED/research/live/master.json
                                 optional. Read only with --keep-metric: its `val_bpb`
                                 (a finite number) becomes the master's metric. Without
                                 --keep-metric the master is measured again by the
                                 baseline run (a metric from other hardware, another budget
                                 or another harness is not comparable with runs here).
    SEED/research/notes.md, do-not-repeat.md, experiments/*.md, campaigns/**
                                 optional prose, copied over the new lab's (the seed's
                                 words win); nothing else of research/ is read.

Nothing in SEED_DIR is changed. Any refusal happens before DIR is created.
"""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from controller.core import figures
from controller.core.hashing import check_candidate_source, parse_python
from controller.lab.init import LabInitError, bench_source_dir, make_lab
from controller.lab.ledger import COLUMNS, SEED_COLUMNS, Ledger
from controller.lab.paths import LabPaths

PROSE = ("notes.md", "do-not-repeat.md")
PROSE_DIRS = ("experiments", "campaigns")


@dataclass
class SeedImport:
    """What was read from the seed lab (before anything is written)."""

    source: str
    rows: list[dict] = field(default_factory=list)
    metric: float | None = None
    prose: list[tuple[Path, Path]] = field(default_factory=list)  # (seed file, relative path)
    dropped_columns: list[str] = field(default_factory=list)
    repeated_runs: int = 0


def _prepare_names() -> set[str]:
    tree = parse_python((bench_source_dir() / "prepare.py").read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prepare_"):  # its siblings' names
            names.update(a.asname or a.name for a in node.names if a.name != "*")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
    return names


def read_train(path: Path) -> str:
    if not path.is_file():
        raise LabInitError(f"{path}: missing; a seed lab keeps its experiment surface in "
                           "train.py at its top level (pass the seed lab's root to --from)")
    raw = path.read_bytes()
    refused = check_candidate_source(raw, "train.py")
    if refused is not None:
        raise LabInitError(f"{path}: {refused.message}")
    source = raw.decode("utf-8")
    try:
        tree = parse_python(source, str(path))
    except SyntaxError as e:
        raise LabInitError(f"{path}: line {e.lineno}: {e.msg}; fix train.py, then import "
                           "again") from None
    known = _prepare_names()
    missing = sorted({a.name for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.module == "prepare"
                      for a in node.names if a.name != "*" and a.name not in known})
    if missing:
        raise LabInitError(f"{path}: imports {', '.join(missing)} from prepare, which Autolab's "
                           "bench/prepare.py does not define; train.py runs under Autolab's "
                           "harness, so port it to bench/prepare.py's names first")
    return source


def read_ledger(path: Path, found: SeedImport) -> None:
    if not path.exists():
        return
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LabInitError(f"{path}: cannot read it as UTF-8 text ({e})") from None
    lines = list(csv.reader(io.StringIO(text), delimiter="\t", quoting=csv.QUOTE_NONE))
    lines = [ln for ln in lines if ln and any(f.strip() for f in ln)]
    if not lines:
        return
    header = [h.strip() for h in lines[0]]
    if header[:len(SEED_COLUMNS)] != SEED_COLUMNS:
        raise LabInitError(f"{path}: line 1 must begin with the seed ledger's 17 columns "
                           f"({' '.join(SEED_COLUMNS)}); it has {' '.join(header[:17])}")
    found.dropped_columns = [h for h in header[len(SEED_COLUMNS):] if h not in COLUMNS]
    seen: set[str] = set()
    for number, fields in enumerate(lines[1:], start=2):
        if len(fields) > len(header):
            raise LabInitError(f"{path}: line {number} has {len(fields)} fields, the header "
                               f"{len(header)}; a tab inside a value? fix that line")
        row = {h: v for h, v in zip(header, fields) if h in COLUMNS}
        if not row.get("run_id"):
            raise LabInitError(f"{path}: line {number} has no run_id")
        if row["run_id"] in seen:
            found.repeated_runs += 1
            continue
        seen.add(row["run_id"])
        row["reason"] = "Imported"
        if figures.COLUMN not in row:  # the seed's train.py printed every figure itself
            row[figures.COLUMN] = figures.column(k for k in figures.SEED_IMPORTED if row.get(k))
        found.rows.append(row)


def read_metric(path: Path) -> float:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LabInitError(f"{path}: missing; --keep-metric takes the master's val_bpb from it "
                           "(leave --keep-metric out to measure the master again)") from None
    except (OSError, ValueError) as e:
        raise LabInitError(f"{path}: not valid JSON ({e}); leave --keep-metric out to measure "
                           "the master again") from None
    val = doc.get("val_bpb") if isinstance(doc, dict) else None
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val):
        raise LabInitError(f"{path}: val_bpb is {val!r}, not a finite number; leave "
                           "--keep-metric out to measure the master again")
    return float(val)


def read_seed(seed: Path, keep_metric: bool = False) -> tuple[str, SeedImport]:
    """Everything the import needs from SEED, checked; nothing is written."""
    if not seed.is_dir():
        raise LabInitError(f"--from {seed}: not a directory; pass the seed lab's root (the "
                           "directory that holds train.py and research/)")
    source = read_train(seed / "train.py")
    found = SeedImport(source=str(seed))
    read_ledger(seed / "research" / "results.tsv", found)
    if keep_metric:
        found.metric = read_metric(seed / "research" / "live" / "master.json")
    research = seed / "research"
    for name in PROSE:
        if (research / name).is_file():
            found.prose.append((research / name, Path(name)))
    for d in PROSE_DIRS:
        for f in sorted((research / d).rglob("*")) if (research / d).is_dir() else []:
            if f.is_file() and not f.is_symlink():
                found.prose.append((f, Path(d) / f.relative_to(research / d)))
    return source, found


def import_seed(target: Path, seed: Path, profile: str = "default", data: str = "hub",
                name: str = "default", budget: int | None = None,
                keep_metric: bool = False, min_delta: float | str | None = None,
                max_pairs: int | None = None) -> tuple[Path, SeedImport]:
    """Make a lab in `target` whose master is the seed's train.py, with its ledger and prose."""
    source, found = read_seed(seed.resolve(), keep_metric)
    root = make_lab(target, profile=profile, data=data, name=name, budget=budget, min_delta=min_delta,
                    max_pairs=max_pairs)
    paths = LabPaths.of(root)
    (paths.bench / "train.py").write_text(source, encoding="utf-8")
    for src, rel in found.prose:
        dst = paths.research / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    git = ["git", "-c", "user.name=autolab", "-c", "user.email=autolab@localhost",
           "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["add", "-A"], cwd=root, check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m",
                          f"Import the seed lab {seed.resolve()}: its train.py is the master"],
                   cwd=root, check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                            text=True, check=True).stdout.strip()
    from controller.core.spec import LabSpec
    from controller.lab.repo import LabRepo

    repo = LabRepo(root, LabSpec(profile=profile, data=data, budget_seconds=budget))
    repo.seed_master(commit)
    ledger = Ledger(paths.ledger)
    for row in found.rows:
        ledger.append(row)
    if found.metric is not None:
        repo.set_master_metric(found.metric)
    return root, found
