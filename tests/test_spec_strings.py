"""Hostile text in specs and candidates, and one experiment's failure kept to itself.

A spec is written by people and agents, so any string in it may hold a NUL byte, a
terminal escape or a lone surrogate (what a YAML `"\\ud800"` escape makes). Each is
refused as Invalid, naming the file, the field and the fix, before it reaches git, a
file name or a terminal. A candidate that declares a source encoding other than UTF-8
is refused too: Python would run other text than the controller compiled and hashed.
And a pass over the lab goes on when one experiment cannot be reconciled.

The lab is real (`init_lab`, git, the pre-run checks, `LocalLab.step`); only the run
backend is a stand-in that records what it is asked to start, so no test trains.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from controller.backends import Backend
from controller.core.diffs import DiffRefused, parse_surface_diff
from controller.core.failures import RECONCILE_ERROR, RECONCILED
from controller.core.hashing import check_candidate_source
from controller.core.reconcile import RunObservation
from controller.core.spec import ExperimentSpec, SpecError, trackable, validate_document
from controller.local import LocalLab, init_lab
from labkit import spec_from_edit

BAD = {  # kind: (the character, how the refusal names it)
    "nul": ("\x00", "a NUL byte (U+0000)"),
    "bell": ("\x07", "the bell character (U+0007)"),
    "escape": ("\x1b", "the escape character (U+001B)"),
    "surrogate": ("\ud800", "a lone surrogate (U+D800)"),
}
FIELDS = ("hypothesis", "campaign", "parent", "diff")
GOOD_EDIT = ("MATRIX_LR = 0.02", "MATRIX_LR = 0.03")


class RecordingBackend(Backend):
    """Stands in for the local backend: runs start (and stay running) on paper."""

    name = "local"

    def __init__(self):
        self.runs: dict[str, str | None] = {}

    def submit(self, req) -> RunObservation:
        self.runs[req.run] = req.slot
        return RunObservation(req.run, "running")

    def observe(self, run: str) -> RunObservation:
        return RunObservation(run, "running" if run in self.runs else "missing")

    def cancel(self, run: str) -> RunObservation:
        self.runs.pop(run, None)
        return RunObservation(run, "cancelled")

    def slot_of(self, run: str) -> str | None:
        return self.runs.get(run)

    def cleanup(self, run: str) -> None:
        pass  # nothing on paper to remove

    def leftovers(self, run: str) -> bool:
        return False


def new_lab(root: Path) -> LocalLab:
    lab = init_lab(root, profile="tiny", data="synthetic", min_delta=0)  # one run decides
    lab.repo.set_master_metric(9.9)  # no baseline run: the checks are under test
    lab.backends["local"] = RecordingBackend()
    return lab


def write_spec(lab: LocalLab, fname: str, doc: dict) -> Path:
    """As an agent writes one: YAML, where unprintable characters become escapes."""
    path = lab.root / "experiments" / f"{fname}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    time.sleep(0.01)  # distinct mtimes: the pass takes specs oldest first
    return path


def with_bad(lab: LocalLab, field: str, ch: str, name: str) -> dict:
    doc = spec_from_edit(lab, name, *GOOD_EDIT, hypothesis="A higher Muon LR trains faster.")
    s = doc["spec"]
    if field == "hypothesis":
        s["hypothesis"] = f"A higher Muon LR{ch} trains faster."
    elif field == "campaign":
        s["campaign"] = f"lr{ch}"
    elif field == "parent":
        s["parent"] = s["parent"][:8] + ch
    else:
        s["diff"] = s["diff"].replace("+MATRIX_LR = 0.03", f"+MATRIX_LR = 0.03 # {ch}")
    return doc


def status(lab: LocalLab, name: str) -> dict:
    return json.loads((lab.root / ".autolab" / "status" / f"{name}.json").read_text())["status"]


def reconcile_events(lab: LocalLab, name: str) -> list[dict]:
    return [e for e in lab.events(name) if e["reason"] == RECONCILE_ERROR]


# --- one lab, one pass: every refusal, three experiments that cannot be reconciled, one good ---

@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AUTOLAB_GPUS", "0,1")  # two slots: the good one and the one that fails to submit
    mp.setenv("AUTOLAB_TRACKING", "0")
    lab = new_lab(tmp_path_factory.mktemp("strings") / "lab")
    # Written first, so each is reconciled before the good one, in both halves of the pass.
    broken = spec_from_edit(lab, "broken-json", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.45")
    write_spec(lab, "broken-json", broken)
    (lab.state / "status").mkdir(parents=True, exist_ok=True)
    (lab.state / "status" / "broken-json.json").write_text('{"metadata": {"name": "broke')
    odd = spec_from_edit(lab, "broken-shape", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.55")
    write_spec(lab, "broken-shape", odd)
    (lab.state / "status" / "broken-shape.json").write_text(json.dumps({
        "metadata": {"name": "broken-shape"}, "spec": odd["spec"], "generation": 1,
        "status": {"phase": "Pending", "job": "exp-broken-shape-1"}}))
    cluster = spec_from_edit(lab, "cluster-only", "WARMDOWN_RATIO = 0.5", "WARMDOWN_RATIO = 0.6")
    cluster["spec"]["backend"] = "kubernetes"  # valid, but not something the local loop has
    write_spec(lab, "cluster-only", cluster)
    for field in FIELDS:
        for kind, (ch, _) in BAD.items():
            write_spec(lab, f"{field}-{kind}", with_bad(lab, field, ch, f"{field}-{kind}"))
    for kind, (ch, _) in BAD.items():
        doc = spec_from_edit(lab, "x", *GOOD_EDIT)
        doc["metadata"]["name"] = f"name{ch}{kind}"
        write_spec(lab, f"name-{kind}", doc)
    for label, name in (("traversal", "../../outside-the-lab"), ("long", "n" * 300)):
        doc = spec_from_edit(lab, "x", *GOOD_EDIT)
        doc["metadata"]["name"] = name
        write_spec(lab, f"name-{label}", doc)
    latin = spec_from_edit(lab, "latin1-cookie", '"""Pretrain a small GPT',
                           '# -*- coding: latin-1 -*-\n"""Pretrain a small GPT')
    write_spec(lab, "latin1-cookie", latin)
    write_spec(lab, "good-lr", spec_from_edit(lab, "good-lr", *GOOD_EDIT))
    lab.passes = [lab.step(), lab.step()]
    yield lab
    mp.undo()


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_character_in_a_spec_field_ends_invalid_naming_the_field(lab, field, kind):
    st = status(lab, f"{field}-{kind}")
    assert (st["phase"], st["reason"]) == ("Invalid", "InvalidSpec")
    path = lab.root / "experiments" / f"{field}-{kind}.yaml"
    assert st["message"].startswith(f"{path}: spec.{field}: contains {BAD[kind][1]} at ")
    assert "remove it" in st["message"] or "write the character itself" in st["message"]
    assert not lab.repo.has_worktree(f"{field}-{kind}")


@pytest.mark.parametrize("kind", list(BAD))
def test_a_name_that_cannot_name_files_is_refused_with_its_file(lab, kind):
    path = lab.root / "experiments" / f"name-{kind}.yaml"
    errors = lab.passes[0].errors
    assert f"{path}: metadata.name: contains {BAD[kind][1]} at character 5" in "\n".join(errors)
    assert not [p for p in (lab.state / "status").iterdir() if p.name.startswith("name")]


def test_names_that_escape_the_lab_or_overflow_a_file_name_write_nothing(lab):
    errors = "\n".join(lab.passes[0].errors)
    assert "name-traversal.yaml: metadata.name: expected a lowercase DNS label" in errors
    assert "name-long.yaml: metadata.name: is 300 characters; at most 50 allowed" in errors
    outside = lab.root.parent
    assert sorted(p.name for p in outside.iterdir()) == ["lab"], "nothing beside the lab"


def test_a_candidate_declaring_another_source_encoding_is_invalid(lab):
    st = status(lab, "latin1-cookie")
    assert (st["phase"], st["reason"]) == ("Invalid", "SourceEncoding")
    assert st["message"] == ("bench/train.py line 1 declares the source encoding 'latin-1'; "
                             "only UTF-8 source is accepted: remove the coding declaration")
    assert not lab.repo.has_worktree("latin1-cookie")


def test_one_experiment_failing_to_reconcile_does_not_stop_the_others(lab):
    good = status(lab, "good-lr")
    assert good["phase"] == "Running" and good["job"]["name"] == "exp-good-lr-1"
    assert "exp-good-lr-1" in lab.backends["local"].runs
    errors = "\n".join(lab.passes[0].errors)
    for name in ("broken-json", "broken-shape"):
        assert f"reconciling {name} failed: " in errors
    assert ("its status file " + str(lab.state / "status" / "broken-json.json")
            + " cannot be read") in errors


def test_a_backend_the_local_loop_lacks_is_invalid_before_any_run(lab):
    st = status(lab, "cluster-only")
    assert (st["phase"], st["reason"]) == ("Invalid", "InvalidSpec")
    assert "spec.backend: kubernetes is not available on one machine" in st["message"]
    assert not st.get("job")


def test_a_failure_is_told_on_the_experiment_once_not_on_every_pass(lab):
    for name in ("broken-shape",):
        cond = next(c for c in status(lab, name)["conditions"] if c["type"] == RECONCILED)
        assert (cond["status"], cond["reason"]) == ("False", RECONCILE_ERROR)
        assert cond["message"].startswith(f"reconciling {name} failed: ")
        assert len(reconcile_events(lab, name)) == 1, "two passes, one event"
    assert len(reconcile_events(lab, "broken-json")) == 1
    assert status(lab, "broken-shape")["phase"] == "Pending", "the phase is left alone"


def test_a_failure_that_heals_turns_its_condition_back(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = new_lab(tmp_path / "lab")
    doc = spec_from_edit(lab, "heals", *GOOD_EDIT)
    write_spec(lab, "heals", doc)
    record = {"metadata": {"name": "heals"}, "spec": doc["spec"], "generation": 1,
              "specDigest": "", "status": {"phase": "Pending", "job": "exp-heals-1"}}
    lab.write_record("heals", record)
    summary = lab.step()
    assert any(e.startswith("reconciling heals failed: ") for e in summary.errors), summary.errors
    record = lab.read_record("heals")
    del record["status"]["job"]  # a person mends the status
    lab.write_record("heals", record)
    summary = lab.step()
    assert summary.errors == []
    st = status(lab, "heals")
    cond = next(c for c in st["conditions"] if c["type"] == RECONCILED)
    assert (cond["status"], cond["reason"]) == ("True", "Recovered")
    assert st["phase"] == "Running"


def test_a_candidate_too_deeply_nested_to_compile_is_invalid_not_a_crash(lab):
    deep = GOOD_EDIT[0] + "\nX = " + "+".join(["1"] * 30000)  # 60 kB: within the diff limit
    doc = spec_from_edit(lab, "deep", GOOD_EDIT[0], deep)
    c = lab.repo.materialise("deep", ExperimentSpec.from_dict(doc["spec"]))
    assert (c.refusal, c.reason) == ("Invalid", "CompileError")
    assert "nested too deeply" in c.message
    assert not lab.repo.has_worktree("deep")


# --- the pure checks ----------------------------------------------------------------------------

SOURCE = '"""A surface."""\nLR = 0.02\n'


@pytest.mark.parametrize("data, reason", [
    (SOURCE.encode(), None),
    (b"# -*- coding: utf-8 -*-\n" + SOURCE.encode(), None),
    (b"#!/usr/bin/env python\n# coding=utf8\n" + SOURCE.encode(), None),
    (b"# -*- coding: latin-1 -*-\n" + SOURCE.encode(), "SourceEncoding"),
    (b"# vim: set fileencoding=utf-16 :\n" + SOURCE.encode(), "SourceEncoding"),
    (b"#!/usr/bin/env python\n# coding: cp1252\n" + SOURCE.encode(), "SourceEncoding"),
    (b"\n\n# coding: latin-1\n" + SOURCE.encode(), None),  # line 3: Python ignores it too
    (b"\xef\xbb\xbf" + SOURCE.encode(), "SourceEncoding"),
    (SOURCE.encode() + b"S = '\xe9'\n", "SourceEncoding"),  # latin-1 bytes, not UTF-8
    (SOURCE.encode() + b"S = '\x00'\n", "CompileError"),
])
def test_only_plain_utf8_source_is_a_candidate(data, reason):
    refused = check_candidate_source(data)
    assert (refused.reason if refused else None) == reason


def test_a_coding_declaration_makes_python_run_other_text_than_was_compiled(tmp_path):
    """Why the cookie is refused: the controller's str and Python's reading of the bytes differ."""
    data = "# -*- coding: latin-1 -*-\nprint(len('é'))\n".encode("utf-8")
    (tmp_path / "t.py").write_bytes(data)
    ran = subprocess.run([sys.executable, str(tmp_path / "t.py")], capture_output=True,
                         text=True, check=True).stdout.strip()
    checked: list = []
    exec(compile(data.decode("utf-8"), "t", "exec"), {"print": checked.append})
    assert (ran, checked) == ("2", [1]), "Python runs two characters where we compiled one"


@pytest.mark.parametrize("text, where", [
    ("+x = 1  # \x00\n", "a NUL byte (U+0000) at line 4, column 11"),
    ("+x = 1  # \u202e\n", "the bidirectional control U+202E at line 4, column 11"),
    ("+x = 1  # \r \n", "a carriage return (U+000D) at line 4, column 11"),
])
def test_the_diff_parser_refuses_characters_a_diff_may_not_carry(text, where):
    diff = "--- a/train.py\n+++ b/train.py\n@@ -1 +1 @@\n" + text
    with pytest.raises(DiffRefused) as e:
        parse_surface_diff(diff)
    assert e.value.reason == "DiffUnsafeCharacter"
    assert str(e.value).startswith(f"diff contains {where}")


def test_a_crlf_diff_is_read_as_lf():
    diff = "--- a/train.py\r\n+++ b/train.py\r\n@@ -1 +1 @@\r\n-a\r\n+b\r\n"
    assert parse_surface_diff(diff).text == ("--- a/bench/train.py\n+++ b/bench/train.py\n"
                                             "@@ -1 +1 @@\n-a\n+b\n")


def doc_with(**spec) -> dict:
    return {"apiVersion": "autolab.dev/v1alpha1", "kind": "Experiment",
            "metadata": {"name": "x"},
            "spec": {"hypothesis": "h", "parent": "abcd", "diff": "d", **spec}}


def test_multiline_fields_keep_newlines_and_tabs():
    validate_document(doc_with(hypothesis="Two lines,\n\tindented.\r\nCRLF too."))


@pytest.mark.parametrize("doc, expect", [
    ({**doc_with(), "metadata": {"name": "abc\n"}},  # `$` alone lets a trailing newline by
     "metadata.name: contains a line break (U+000A) at character 4"),
    (doc_with(campaign="two\tparts"), "spec.campaign: contains a tab (U+0009) at character 4"),
    ({**doc_with(), "spec": {**doc_with()["spec"], 1: "a", "zz": "b"}},
     "spec: field names must be text, got int 1"),
    (doc_with(hypothesis=yaml.safe_load("d: 2024-05-01")["d"]),
     "spec.hypothesis: expected text, a number, true/false, a list or a mapping, got date"),
])
def test_spec_text_and_shape_refusals_name_the_field(doc, expect):
    with pytest.raises(SpecError) as e:
        validate_document(doc, source="experiments/x.yaml")
    assert str(e.value).startswith(f"experiments/x.yaml: {expect}")


def test_yaml_aliases_cannot_blow_a_spec_up():
    text = "\n".join(["apiVersion: autolab.dev/v1alpha1", "kind: Experiment",
                      "metadata: {name: bomb}", "spec:", "  hypothesis: h", "  parent: abcd",
                      "  diff: d", "  a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
                     + [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)])
    doc = yaml.safe_load(text)  # cheap: the aliases are shared, 10**9 values once expanded
    started = time.perf_counter()
    with pytest.raises(SpecError, match="more than 10000 values"):
        validate_document(doc)
    assert not trackable(doc)
    assert time.perf_counter() - started < 1


# --- the operator -------------------------------------------------------------------------------

class FakeKube:
    """The two calls the operator's failure path makes."""

    def __init__(self, obj: dict):
        self.obj = obj
        self.patches: list[dict] = []

    def get_custom(self, namespace, plural, name):
        return self.obj

    def patch_status(self, namespace, plural, name, status):
        self.patches.append(status)
        self.obj["status"] = status


def test_operator_turns_a_known_failure_into_a_permanent_error_told_once(monkeypatch):
    kopf = pytest.importorskip("kopf")
    from controller.operator import Operator, OperatorConfig

    obj = {"metadata": {"name": "x", "namespace": "ns", "generation": 3},
           "status": {"phase": "Queued"}}
    op = Operator(OperatorConfig(), kube=FakeKube(obj))
    events: list = []
    monkeypatch.setattr(op, "_event", lambda o, e, fact=None: events.append(e) or True)

    def fails(namespace, name, **_):
        raise SpecError("backend 'hf' needs a token; set HF_TOKEN")
    monkeypatch.setattr(op, "reconcile_experiment", fails)
    for _ in range(2):
        with pytest.raises(kopf.PermanentError, match="reconciling x failed: backend 'hf'"):
            op._guarded("ns", "x")
    assert len(op.kube.patches) == 1 and len(events) == 1, "told once"
    cond = op.kube.patches[0]["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == (RECONCILED, "False",
                                                             RECONCILE_ERROR)
    assert events[0].reason == RECONCILE_ERROR
    assert ("ns", "x") not in op.unsettled
    # The timer leaves it alone at that generation; a changed object is tried again.
    asyncio.run(op.experiment_tick("ns", "x", status=obj["status"], meta={"generation": 3}))
    assert op._queued == set()
    assert op.failed[("ns", "x")] == 3


def test_a_failed_pass_gives_back_the_slot_it_was_granted(tmp_path):
    from controller.core.spec import LabSpec
    from controller.engine import Engine, Observed
    from controller.lab.paths import LabPaths

    status = {"phase": "Queued", "queuedAt": "t1"}

    class Statuses:  # the experiment as its front end last wrote it
        def read(self, name):
            return Observed(name, name, {"priority": 0}, dict(status))

    engine = Engine(paths=LabPaths.of(tmp_path), lab_name="x",
                    lab=LabSpec.from_dict({"capacity": {"gpuSlots": 1},
                                                    "promotion": {"minDelta": 0}}), statuses=Statuses(),
                    master=None, events=None, backends={}, make_backend=None,
                    visible_slots=lambda n: ["slot-0"])
    book = engine.book
    assert book.grant("first", 0, "t1") == "slot-0"
    engine._restore("first")  # its pass failed before anything was submitted
    assert book.held == {}, "the slot went back"
    assert set(book.waiting) == {"first"}, "and it waits in line, as its status says"
    assert book.grant("second", 0, "t2") is None, "first in line goes first"
    assert book.grant("first", 0, "t1") == "slot-0"
    status["job"] = "not a mapping"
    engine._restore("first")
    assert book.held == {} and "first" not in book.running


def test_a_submit_that_raises_is_tried_again_on_the_same_slot(tmp_path, monkeypatch):
    """One GPU slot; the first experiment's submit fails (the backend is away for a moment).
    Its status already names the run and the slot (written before the submit, so a crash in
    between heals), so the slot stays its own, the next experiment does not take it, and the
    next pass submits the same run on it: one run, never two."""
    monkeypatch.setenv("AUTOLAB_GPUS", "0")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = new_lab(tmp_path / "lab")
    backend = lab.backends["local"]
    real_submit = backend.submit
    away = {"first"}

    def submit(req):
        if req.experiment in away:
            raise OSError("the run directory's disk is gone")
        return real_submit(req)
    backend.submit = submit
    write_spec(lab, "first", spec_from_edit(lab, "first", *GOOD_EDIT, priority=5))
    write_spec(lab, "second", spec_from_edit(lab, "second", "MATRIX_LR = 0.02", "MATRIX_LR = 0.04"))
    summary = lab.step()
    assert any(e.startswith("reconciling first failed: OSError") for e in summary.errors)
    assert backend.runs == {}, "nothing started"
    job = status(lab, "first")["job"]
    assert (job["backend"], job["name"], job["slot"]) == ("local", "exp-first-1", "0")
    assert not status(lab, "second").get("job"), "the slot is first's: second waits"
    away.clear()
    summary = lab.step()
    assert backend.runs == {"exp-first-1": "0"}
    assert not status(lab, "second").get("job")
    assert summary.errors == []


def test_a_candidate_whose_run_was_lost_may_run_again(tmp_path, monkeypatch):
    """A lost run measured nothing: it is run again at its place, and after the bound the
    experiment ends RunsLost; the same program under a new name is then queued, not refused
    as a Duplicate of it (a candidate failure would have been)."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = new_lab(tmp_path / "lab")
    backend = lab.backends["local"]
    real_observe = backend.observe
    backend.observe = lambda run: (RunObservation(run, "lost", message="the node went away")
                                   if run.startswith("exp-first-") else real_observe(run))
    write_spec(lab, "first", spec_from_edit(lab, "first", *GOOD_EDIT))
    for _ in range(12):
        lab.step()
        if status(lab, "first")["phase"] == "Failed":
            break
    assert (status(lab, "first")["phase"], status(lab, "first")["reason"]) == ("Failed", "RunsLost")
    assert [(r["run_id"], r["status"]) for r in lab.ledger.rows()
            if r["experiment_id"] == "first"] == [
        ("exp-first-1", "lost"), ("exp-first-1-t2", "lost"), ("exp-first-1-t3", "lost"),
        ("exp-first-1-t4", "error")]
    write_spec(lab, "again", spec_from_edit(lab, "again", *GOOD_EDIT))
    lab.step()
    assert status(lab, "again")["phase"] in ("Queued", "Running"), status(lab, "again")


def test_a_winner_resubmitted_after_its_promotion_is_a_duplicate_of_the_master(tmp_path,
                                                                               monkeypatch):
    """The same change under a new name, written against the master it has since replaced:
    the rebase is empty, the candidate is the master itself, so Duplicate (not Conflict)."""
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = new_lab(tmp_path / "lab")
    doc = spec_from_edit(lab, "winner", *GOOD_EDIT)
    c = lab.repo.materialise("winner", ExperimentSpec.from_dict(doc["spec"]))
    assert lab.repo.promote("winner", c.commit, 9.0, (c.candidate_hash, c.semantic_hash),
                            c.parent_hash, "2026-12-01T00:00:00Z").promoted
    write_spec(lab, "winner-again", {**doc, "metadata": {"name": "winner-again"}})
    lab.step()
    st = status(lab, "winner-again")
    assert (st["phase"], st["reason"]) == ("Duplicate", "DuplicateCandidate"), st
    assert st["duplicateOf"].startswith("master (winner")


def test_a_queued_experiment_runs_the_spec_it_was_checked_with_after_its_file_breaks(
        tmp_path, monkeypatch):
    """Checked and waiting for the one slot, then its file is edited into an invalid spec: the
    checked copy runs when the slot frees (the edit is reported, not run, and nothing fails)."""
    monkeypatch.setenv("AUTOLAB_GPUS", "0")
    monkeypatch.setenv("AUTOLAB_TRACKING", "0")
    lab = new_lab(tmp_path / "lab")
    backend = lab.backends["local"]
    write_spec(lab, "first", spec_from_edit(lab, "first", *GOOD_EDIT))
    write_spec(lab, "second", spec_from_edit(lab, "second", "MATRIX_LR = 0.02", "MATRIX_LR = 0.04"))
    lab.step()
    assert list(backend.runs) == ["exp-first-1"] and status(lab, "second")["phase"] == "Queued"
    broken = spec_from_edit(lab, "second", "MATRIX_LR = 0.02", "MATRIX_LR = 0.05")
    broken["spec"]["noSuchField"] = 1
    write_spec(lab, "second", broken)
    real_observe = backend.observe  # the first run ends (the candidate crashed): the slot frees
    backend.observe = lambda run: (RunObservation(run, "failed", result={
        "status": "failed", "reason_code": "CandidateCrashed", "reason": "loss is NaN"})
        if run == "exp-first-1" else real_observe(run))
    lab.step()
    summary = lab.step()
    assert summary.errors == [], summary.errors
    assert "exp-second-1" in backend.runs
    conds = {c["type"]: c for c in status(lab, "second")["conditions"]}
    assert conds["SpecChangeIgnored"]["status"] == "True"


UNREADABLE = [
    ("latin1-bytes", "metadata: {name: caf\xe9}\n".encode("latin-1")),
    ("deep-nesting", b"spec: " + b"[" * 100_000 + b"]" * 100_000 + b"\n"),
    ("huge-integer", b"metadata: {name: x}\nspec: {priority: " + b"1" * 5000 + b"}\n"),
    ("metadata-list", b"metadata: [1]\nspec: {}\n"),
]


# Named by label only: an id made of 200 kB of brackets lands in PYTEST_CURRENT_TEST, and every
# process the test starts (git) is refused its environment (E2BIG).
@pytest.mark.parametrize("label, content", UNREADABLE, ids=[label for label, _ in UNREADABLE])
def test_an_unreadable_spec_file_is_a_file_error_not_a_crash(tmp_path, label, content):
    lab = new_lab(tmp_path / "lab")
    (lab.root / "experiments" / f"{label}.yaml").write_bytes(content)
    summary = lab.step()  # must not raise
    errors = "\n".join(summary.errors)
    assert f"{label}.yaml" in errors
    assert not (lab.state / "status").exists() or not list((lab.state / "status").iterdir())
