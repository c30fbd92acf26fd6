"""The compile cache of the lab's starting program: kept once, copied to every run, written by no candidate.

bench/run.py --compile-cache-from SHA1: the first run of exactly the bytes with that sha1 (the
lab's starting train.py, its owner's code) keeps its compile cache under the data cache; every
run starts with a copy in its own scratch. These tests run the real harness in its sandbox on
the tiny CPU profile. The CPU build of train.py does not compile, so the programs here write
their "compile cache" themselves, through the same environment variables torch.compile uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def harness(bench, tmp: Path, code: str, starting: str) -> tuple[dict, str]:
    cand = tmp / "cand" / "train.py"
    cand.parent.mkdir(parents=True)
    cand.write_text(code)
    done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(cand),
                           "--result", str(tmp / "r.json"), "--source", "synthetic", "--budget", BUDGET,
                           "--sandbox", "bwrap", "--compile-cache-from", starting],
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



def test_copying_leaves_out_links_fifos_and_stops_at_the_limit(bench, tmp_path):
    src = tmp_path / "src"
    (src / "a" / "b").mkdir(parents=True)
    (src / "a" / "b" / "f").write_bytes(b"x" * 10)
    os.symlink("/etc/passwd", src / "a" / "passwd")
    os.symlink(src / "a", src / "dirlink")
    os.mkfifo(src / "a" / "fifo")
    files, size = bench.run._copy_tree(src, tmp_path / "dst", limit=100, max_files=10)
    assert (files, size) == (1, 10)
    assert tree(tmp_path / "dst") == {"a/b/f": b"x" * 10}
    assert not any(p.is_symlink() for p in (tmp_path / "dst").rglob("*"))
    with pytest.raises(bench.run._TooBig):
        bench.run._copy_tree(src, tmp_path / "dst2", limit=9, max_files=10)


def test_the_option_takes_a_sha1_and_nothing_else(bench, tmp_path):
    for bad in ("../../etc", "ABC", "0" * 39, "g" * 40):
        done = subprocess.run([sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(TRAIN),
                               "--result", str(tmp_path / "r.json"), "--compile-cache-from", bad],
                              env=env_for(bench.cache), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "is not a sha1" in done.stderr, done.stderr
