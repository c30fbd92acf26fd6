"""Profile numbers are defined once, in bench/prepare.py; the controller reads them from there."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from controller.lab import clock, profiles

REPO = Path(__file__).resolve().parents[1]


def test_the_profiles_read_are_the_ones_prepare_defines():
    # Import the real harness in a subprocess (it reads the environment and imports numpy).
    code = ("import dataclasses, json, sys; sys.path.insert(0, 'bench'); import prepare; "
            "print(json.dumps({n: dataclasses.asdict(p) for n, p in prepare.PROFILES.items()}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True,
                         text=True, env={**os.environ, "AUTOLAB_BENCH_PROFILE": "tiny"})
    defined = json.loads(out.stdout)
    read = profiles.profiles()
    assert {n: dict(p.values) for n, p in read.items()} == defined
    assert set(read) >= {"default", "tiny"}
    for name, p in read.items():
        assert p.name == name and p.source == REPO / "bench" / "prepare.py"
        assert p.time_budget == float(defined[name]["time_budget"])
        assert p.startup_allowance == float(defined[name]["startup_allowance"])
        assert p.export_allowance == float(defined[name]["export_allowance"])
        assert p.eval_timeout == float(defined[name]["eval_timeout"])
        assert p.max_seq_len == defined[name]["max_seq_len"]  # any field, as an attribute
    assert profiles.profile("tiny") == read["tiny"]
    with pytest.raises(profiles.ProfileError, match=r"prepare\.py: no profile 'huge'"):
        profiles.profile("huge")


def test_the_file_is_parsed_never_run(tmp_path):
    (tmp_path / "prepare.py").write_text(
        "import nothing_of_the_sort\nraise SystemExit('ran')\n"
        "class Profile:\n    name: str\n    time_budget: float\n"
        "PROFILES = {'x': Profile('x', 2 * 3.5, startup_allowance=1, export_allowance=0,\n"
        "                          eval_timeout=-(-9), eval_tokens=16 * 2**10)}\n")
    (p,) = profiles.profiles(tmp_path).values()
    assert (p.name, p.time_budget, p.eval_timeout, p.eval_tokens) == ("x", 7.0, 9.0, 16384)


@pytest.mark.parametrize("text,why", [
    ("X = 1\n", r": no module-level `PROFILES"),
    ("PROFILES = dict()\n", r":1: PROFILES is not a non-empty dict literal"),
    ("PROFILES = {'a': Profile(time_budget=BUDGET, startup_allowance=1, export_allowance=1,"
     " eval_timeout=1)}\n", r":1: PROFILES\['a'\]\.time_budget = BUDGET is not a constant"),
    ("PROFILES = {'a': Profile(startup_allowance=1, export_allowance=1, eval_timeout=1)}\n",
     r":1: PROFILES\['a'\] has no time_budget"),
    ("PROFILES = {'a': Profile(**common)}\n", r":1: PROFILES\['a'\]: \*\*arguments"),
    ("PROFILES = {\n", r":1: not Python"),
])
def test_a_file_it_cannot_read_is_an_error_naming_it(tmp_path, text, why):
    (tmp_path / "prepare.py").write_text(text)
    with pytest.raises(profiles.ProfileError, match=re.escape(str(tmp_path / "prepare.py")) + why):
        profiles.profiles(tmp_path)
    with pytest.raises(profiles.ProfileError, match=re.escape(str(tmp_path / "none")) + ".*cannot read"):
        profiles.profiles(tmp_path / "none")


def test_an_edited_file_is_read_again(tmp_path):
    src = "PROFILES = {{'a': Profile(time_budget={}, startup_allowance=1, export_allowance=1, eval_timeout=1)}}\n"
    (tmp_path / "prepare.py").write_text(src.format(5))
    assert profiles.profile("a", tmp_path).time_budget == 5
    (tmp_path / "prepare.py").write_text(src.format(50))
    assert profiles.profile("a", tmp_path).time_budget == 50


def test_the_kubernetes_backend_budgets_by_the_profile():
    from controller.backends import kubernetes
    assert kubernetes._profile_budget("tiny") == profiles.profile("tiny").time_budget
    assert kubernetes._profile_budget("nonesuch") == profiles.profile("default").time_budget


def test_clock():
    assert clock.iso(0) == "1970-01-01T00:00:00Z"
    now = clock.utcnow()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", now)
    assert clock.iso(clock.parse(now).timestamp()) == now


# --- a lab's own pinned harness ------------------------------------------------------------------

@pytest.fixture()
def odd_lab(tmp_path, monkeypatch):
    """A tiny lab whose pinned bench/prepare.py gives the tiny profile other numbers (7 s budget,
    61 s start-up allowance, 121 s evaluation), and whose editable copy says yet another thing."""
    from controller.local import init_lab
    from controller.lab import init

    bench = tmp_path / "bench-src"
    shutil.copytree(REPO / "bench", bench, ignore=shutil.ignore_patterns("perf", "__pycache__"))
    text = (bench / "prepare.py").read_text()
    start = text.index('"tiny": Profile(')
    tiny = text[start:text.index("),", start)]
    new = (tiny.replace("time_budget=4.0", "time_budget=7.0")
           .replace("startup_allowance=60.0", "startup_allowance=61.0")
           .replace("eval_timeout=120.0", "eval_timeout=121.0"))
    assert new.count("=7.0") == new.count("=61.0") == new.count("=121.0") == 1, tiny
    (bench / "prepare.py").write_text(text.replace(tiny, new))
    monkeypatch.setattr(init, "bench_source_dir", lambda: bench)
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    editable = lab.root / "bench" / "prepare.py"
    editable.write_text(editable.read_text().replace("time_budget=7.0", "time_budget=99.0"))
    return lab


def test_the_report_holds_a_lab_to_its_pinned_budget(odd_lab):
    from controller.lab import report
    assert profiles.lab_harness(odd_lab.root).parent.parent.name == "harness"  # the pinned copy
    assert profiles.lab_profile(odd_lab.root, "tiny").time_budget == 7.0
    assert report.default_stuck_after(odd_lab) == 3 * 7.0 + report.STUCK_SLACK_SECONDS


def test_hf_costs_a_run_by_the_labs_pinned_profile(odd_lab):
    from controller.cli import hf
    c = hf.run_cost(odd_lab)
    assert (c.budget, c.startup_allowance, c.eval_timeout) == (7.0, 61.0, 121.0)


def test_a_directory_without_a_pinned_harness_uses_its_own_then_the_repositorys(tmp_path):
    assert profiles.lab_harness(tmp_path) == REPO / "bench" / "prepare.py"
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "prepare.py").write_text("")
    assert profiles.lab_harness(tmp_path) == tmp_path / "bench" / "prepare.py"
