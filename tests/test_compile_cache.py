"""The compile cache of the lab's starting program: kept once, copied to every run, written by no candidate.

bench/run.py --compile-cache-from SHA1: the first run of exactly the bytes with that sha1 (the
lab's starting train.py, its owner's code) keeps its compile cache under the data cache; every
run starts with a copy in its own scratch. On a machine that never ran those bytes (a lab
resumed on a new host), --starting-program PATH lets the harness build that cache first: it runs
the starting program in the sandbox up to its first batch and keeps what it compiled, so the
first candidate starts warm too; the local backend passes it, unless the lab's pinned harness
predates it. These tests run the real harness in its sandbox on the tiny CPU profile. The CPU
build of train.py does not compile, so the programs here write their "compile cache"
themselves, through the same environment variables torch.compile uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.lab.harness import LEGACY_HARNESS_FILES
from controller.lab.ledger import Ledger
from labkit import spec_from_edit
from test_run_phases import BENCH, TRAIN, bench, env_for  # noqa: F401  (the module fixture)

BUDGET = "2.5"

# The lab's starting program: train.py, after it "compiled" (wrote its caches) at start-up.
STARTING = TRAIN.read_text().replace("\nimport prepare\n", """
import prepare
import os as _os
from pathlib import Path as _P
for _var, _rel, _text in (("TORCHINDUCTOR_CACHE_DIR", "fxgraph/ab/entry", "graph compiled by the starting program"),
                          ("TRITON_CACHE_DIR", "k1/kernel.json", "kernel compiled by the starting program")):
    _f = _P(_os.environ[_var]) / _rel
    if not _f.exists():
        _f.parent.mkdir(parents=True, exist_ok=True)
        _f.write_text(_text)
""", 1)

# A candidate that reads what it was given, then tries to leave something for every later run:
# it rewrites the copied entry, plants files, a link and a FIFO, before its first batch and
# after training, and looks for the kept cache itself.
HOSTILE = TRAIN.read_text().replace("\nimport prepare\n", """
import prepare
import os as _os
from pathlib import Path as _P
_fx, _tr = _P(_os.environ["TORCHINDUCTOR_CACHE_DIR"]), _P(_os.environ["TRITON_CACHE_DIR"])
print("SAW", (_fx / "fxgraph/ab/entry").read_text(), flush=True)

def _plant(when):
    for _d in (_fx / "fxgraph/ab", _tr / "k1"):
        _d.mkdir(parents=True, exist_ok=True)
    (_fx / "fxgraph/ab/entry").write_text("poisoned " + when)
    (_tr / "k1/kernel.json").write_text("poisoned " + when)
    (_fx / ("planted-" + when)).write_text("weights " + when)
    for _name, _make in (("link-" + when, lambda p: _os.symlink("/etc/passwd", p)),
                         ("fifo-" + when, _os.mkfifo)):
        try:
            _make(_fx / _name)
        except OSError:
            pass
    for _root in (_os.environ.get("AUTOLAB_CACHE", ""), "/root/.cache/autolab", "/tmp"):
        _seen = _P(_root, "compile-seeds")
        try:
            print("FOUND", _seen, sorted(_os.listdir(_seen)), flush=True)
        except OSError:
            pass
_plant("at-start-up")
""", 1) + """
_plant("after-training")
"""


def sha1(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def harness(bench, tmp: Path, code: str, starting: str, *extra: str | Path) -> tuple[dict, str]:
    cand = tmp / "cand" / "train.py"
    cand.parent.mkdir(parents=True)
    cand.write_text(code)
    done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(cand),
                           "--result", str(tmp / "r.json"), "--source", "synthetic", "--budget", BUDGET,
                           "--sandbox", "bwrap", "--compile-cache-from", starting, *map(str, extra)],
                          env=env_for(bench.cache), capture_output=True, text=True, timeout=300)
    return json.loads((tmp / "r.json").read_text()), done.stdout + done.stderr


@pytest.fixture
def sandboxed(bench):
    if bench.sandbox.available():
        pytest.skip(bench.sandbox.available())


def test_only_the_starting_program_fills_the_cache_and_a_candidate_changes_nothing_in_it(bench, sandboxed,
                                                                                         tmp_path):
    start = sha1(STARTING)
    entry = bench.cache / "compile-seeds" / "tiny" / start
    assert not entry.exists()

    # A candidate before any run of the starting program: cold, and it keeps nothing. (So the
    # next candidate, below, can only find what the starting program compiled.)
    result, out = harness(bench, tmp_path / "first", HOSTILE.replace("print(\"SAW\"", "0 and print(\"SAW\""),
                          start)
    assert result["status"] == "succeeded", result["reason"]
    assert result["compile_cache"] == {"program": start[:12], "seeded": False, "kept": False}
    assert not entry.exists(), "a candidate's cache was kept"

    # The starting program keeps its cache, as it was written.
    result, out = harness(bench, tmp_path / "start", STARTING, start)
    assert result["status"] == "succeeded", result["reason"]
    assert result["compile_cache"]["kept"] is True, out
    kept = tree(entry)
    assert kept == {"compile/fxgraph/ab/entry": b"graph compiled by the starting program",
                    "triton/k1/kernel.json": b"kernel compiled by the starting program"}

    # A hostile candidate finds the copy in its scratch, does what it likes to it, and the kept
    # cache is byte for byte what the starting program left; the candidate never saw it.
    result, out = harness(bench, tmp_path / "hostile", HOSTILE, start)
    assert result["status"] == "succeeded", result["reason"]
    assert "SAW graph compiled by the starting program" in out
    assert result["compile_cache"]["seeded"] is True and result["compile_cache"]["kept"] is False
    assert result["compile_cache"]["files"] == 2
    assert "FOUND" not in out
    assert tree(entry) == kept
    assert not [p for p in entry.rglob("*") if p.is_symlink() or not (p.is_file() or p.is_dir())]



# --- a fresh machine: no run of the starting program happens here, the harness warms the cache --

# Another starting program (another sha1, so another kept entry than the test above's): a lab
# resumed on a machine where its master was never run.
RESUMED = STARTING + "\n# the lab's starting program, on a machine that never ran it\n"
# A candidate that would crash at start-up without the starting program's cache in its scratch.
READER = TRAIN.read_text().replace("\nimport prepare\n", """
import prepare
import os as _os
from pathlib import Path as _P
print("SAW", (_P(_os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph/ab/entry").read_text(), flush=True)
""", 1)


def test_on_a_fresh_machine_the_first_candidate_warms_the_cache_once_and_every_run_starts_from_it(
        bench, sandboxed, tmp_path):
    start = sha1(RESUMED)
    entry = bench.cache / "compile-seeds" / "tiny" / start
    program = tmp_path / "starting.py"
    program.write_text(RESUMED)

    # The first candidate: the harness runs the starting program up to its first batch, keeps
    # what it compiled, and the candidate starts with a copy. The warm-up is no run: one result,
    # the candidate's, and nothing of the starting program was trained or measured.
    result, out = harness(bench, tmp_path / "first", READER, start, "--starting-program", program)
    assert result["status"] == "succeeded", result["reason"]
    assert result["candidate_sha1"] == sha1(READER)
    warm = result["compile_cache"].pop("warm_up")
    assert warm["kept"] is True and warm["seconds"] > 0, (warm, out)
    assert result["timing"]["warm_up_seconds"] == warm["seconds"]  # not the candidate's start-up
    assert f"compile-cache warm-up {warm['seconds']:.1f}s, start-up" in out
    assert result["compile_cache"] == {"program": start[:12], "seeded": True, "kept": False,
                                       "files": 2, "bytes": result["compile_cache"]["bytes"],
                                       "seconds": result["compile_cache"]["seconds"]}
    assert "SAW graph compiled by the starting program" in out
    assert out.count("warming up the compile cache") == 1 and out.count("running candidate") == 1
    kept = tree(entry)
    assert kept == {"compile/fxgraph/ab/entry": b"graph compiled by the starting program",
                    "triton/k1/kernel.json": b"kernel compiled by the starting program"}

    # The second: the cache is there, so no warm-up; it starts with a copy as well.
    result, out = harness(bench, tmp_path / "second", READER, start, "--starting-program", program)
    assert result["status"] == "succeeded", result["reason"]
    assert "warm_up" not in result["compile_cache"] and "warm_up_seconds" not in result["timing"]
    assert result["compile_cache"]["seeded"] is True
    assert "warming up" not in out
    assert tree(entry) == kept


def test_a_starting_program_that_compiles_nothing_is_warmed_up_once_not_before_every_run(
        bench, sandboxed, tmp_path):
    # bench/train.py compiles on CUDA only: on this CPU its warm-up leaves no cache. The harness
    # keeps an empty entry, so a CPU lab pays for one warm-up, not one per run.
    plain = TRAIN.read_text() + "\n# a lab's starting program that compiles nothing on a CPU\n"
    start = sha1(plain)
    program = tmp_path / "starting.py"
    program.write_text(plain)
    result, out = harness(bench, tmp_path / "first", TRAIN.read_text(), start, "--starting-program", program)
    assert result["status"] == "succeeded", result["reason"]
    assert result["compile_cache"]["warm_up"]["kept"] is True
    assert result["compile_cache"]["seeded"] is False
    entry = bench.cache / "compile-seeds" / "tiny" / start
    assert entry.is_dir() and not [p for p in entry.rglob("*") if not p.is_dir()]
    result, out = harness(bench, tmp_path / "second", TRAIN.read_text(), start, "--starting-program", program)
    assert result["status"] == "succeeded", result["reason"]
    assert result["compile_cache"] == {"program": start[:12], "seeded": False, "kept": False}
    assert "warming up" not in out


def test_the_warm_up_runs_only_the_bytes_the_controller_named(bench, sandboxed, tmp_path):
    # --starting-program whose bytes are not the named program's (here: a candidate's): nothing is
    # run to warm, nothing is kept, and the candidate runs from cold as before.
    start = sha1(RESUMED + "# not these bytes\n")
    entry = bench.cache / "compile-seeds" / "tiny" / start
    impostor = tmp_path / "impostor.py"
    impostor.write_text(HOSTILE)
    result, out = harness(bench, tmp_path / "run", TRAIN.read_text(), start, "--starting-program", impostor)
    assert result["status"] == "succeeded", result["reason"]
    assert result["compile_cache"]["warm_up"]["kept"] is False
    assert "is not the starting program" in result["compile_cache"]["warm_up"]["reason"]
    assert result["compile_cache"]["seeded"] is False
    assert "warming up" not in out and "SAW" not in out
    assert not entry.exists()


def test_copying_leaves_out_links_fifos_and_stops_at_the_limit(bench, tmp_path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_bytes(b"x" * 10)
    os.symlink("/etc/passwd", src / "a" / "passwd")
    os.symlink(src / "a", src / "dirlink")
    os.mkfifo(src / "a" / "fifo")
    files, size = bench.harness.compile_cache._copy_tree(src, tmp_path / "dst", limit=100, max_files=10)
    assert (files, size) == (1, 10)
    assert tree(tmp_path / "dst") == {"a/b/f": b"x" * 10}
    assert not any(p.is_symlink() for p in (tmp_path / "dst").rglob("*"))
    with pytest.raises(bench.harness.compile_cache._TooBig):
        bench.harness.compile_cache._copy_tree(src, tmp_path / "dst2", limit=9, max_files=10)


def test_the_option_takes_a_sha1_and_nothing_else(bench, tmp_path):
    for bad in ("../../etc", "ABC", "0" * 39, "g" * 40):
        done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(TRAIN),
                               "--result", str(tmp_path / "r.json"), "--compile-cache-from", bad],
                              env=env_for(bench.cache), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "is not a sha1" in done.stderr, done.stderr


# --- a lab resumed on a fresh machine, through the local backend ---------------------------------

# The harness as it was before --starting-program (a lab made then pinned these files).
BEFORE_WARM_UP = "2f56e3cc9ff5e52010487dab1085d3d775a81e73"
HARNESS_FILES = LEGACY_HARNESS_FILES  # what a lab pinned then


def resumed_lab(tmp_path: Path, monkeypatch, harness_from: str | None = None):
    """A tiny lab whose starting train.py "compiles" (RESUMED), opened on a machine that never ran
    it: a data cache of its own, and the master's val_bpb already known (measured elsewhere), so
    no run of the starting program happens here. harness_from: a commit of this repository whose
    bench/ harness files the lab pins instead of today's."""
    from controller.local import init_lab
    from controller.lab import init

    src = tmp_path / "bench-src"
    shutil.copytree(BENCH, src, ignore=shutil.ignore_patterns("perf", "__pycache__"))
    (src / "train.py").write_text(RESUMED)
    for name in HARNESS_FILES if harness_from else ():
        old = subprocess.run(["git", "show", f"{harness_from}:bench/{name}"], cwd=BENCH, capture_output=True)
        if old.returncode != 0:
            pytest.skip(f"this checkout has no commit {harness_from[:12]} (a shallow clone)")
        (src / name).write_bytes(old.stdout)
    if harness_from:  # that commit's bench/ had no manifest and no harness modules beside run.py
        for path in (src / "HARNESS", *src.glob("harness_*.py")):
            path.unlink()
    monkeypatch.setattr(init, "bench_source_dir", lambda: src)
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic", budget=2, min_delta=0)
    lab.repo.set_master_metric(9.9)
    return lab


def run_lab(lab, cache: Path, *edits: tuple[str, str, str]) -> dict[str, dict]:
    """Submit one experiment per (name, old, new) edit, `autolab run` until they are done; each
    run's result by experiment name."""
    for name, old, new in edits:
        lab.apply_file(spec_from_edit(lab, name, old, new), "test")
    env = dict(os.environ, PYTHONPATH=str(BENCH.parent), AUTOLAB_CACHE=str(cache))
    done = subprocess.run([sys.executable, "-m", "controller.cli.main", "run", "--lab", str(lab.root),
                           "--interval", "0.2"], env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    runs = lab.root / ".autolab" / "runs"
    return {name: {"result": json.loads((runs / f"exp-{name}-1" / "result.json").read_text()),
                   "cmd": json.loads((runs / f"exp-{name}-1" / "launch.json").read_text())["cmd"],
                   "log": (runs / f"exp-{name}-1" / "log.txt").read_text()}
            for name, _, _ in edits}


def test_a_lab_resumed_on_a_fresh_machine_builds_the_cache_once_and_its_runs_start_warm(
        sandboxed, tmp_path, monkeypatch):
    with resumed_lab(tmp_path, monkeypatch) as lab:
        cache = tmp_path / "fresh-cache"
        runs = run_lab(lab, cache, ("shorter", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"),
                       ("decay", "WEIGHT_DECAY = 0.1 ", "WEIGHT_DECAY = 0.05 "))
        start = sha1(RESUMED)
        first, second = sorted(runs.values(), key=lambda r: r["result"]["timing"]["trained_from"])
        for run in (first, second):  # each run is handed the starting program's bytes, from git
            cmd = run["cmd"]
            assert cmd[cmd.index("--compile-cache-from") + 1] == start
            assert cmd[cmd.index("--starting-program") + 1] == "starting.py"
            assert run["result"]["status"] == "succeeded", run["result"]["reason"]
            assert run["result"]["compile_cache"]["seeded"] is True, run["log"]
        assert first["result"]["compile_cache"]["warm_up"]["kept"] is True
        assert "warm_up" not in second["result"]["compile_cache"], "the cache was built twice"
        assert tree(cache / "compile-seeds" / "tiny" / start) == {
            "compile/fxgraph/ab/entry": b"graph compiled by the starting program",
            "triton/k1/kernel.json": b"kernel compiled by the starting program"}
        # The warm-up is no run: no ledger row, no run directory, no experiment of its own.
        rows = Ledger(lab.root / "research" / "results.tsv").rows()
        assert sorted(r["run_id"] for r in rows) == ["exp-decay-1", "exp-shorter-1"]
        assert sorted(p.name for p in (lab.root / ".autolab" / "runs").iterdir()) == ["exp-decay-1",
                                                                                      "exp-shorter-1"]


def test_a_lab_pinned_before_the_warm_up_still_runs_from_a_cold_cache(sandboxed, tmp_path, monkeypatch):
    with resumed_lab(tmp_path, monkeypatch, harness_from=BEFORE_WARM_UP) as lab:
        assert b"--starting-program" not in (lab.root / "bench" / "run.py").read_bytes()
        run = run_lab(lab, tmp_path / "fresh-cache", ("shorter", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.4"))
        run = run["shorter"]
        assert run["result"]["status"] == "succeeded", run["result"]["reason"]
        assert "--compile-cache-from" in run["cmd"] and "--starting-program" not in run["cmd"]
        assert run["result"]["compile_cache"] == {"program": sha1(RESUMED)[:12], "seeded": False, "kept": False}
