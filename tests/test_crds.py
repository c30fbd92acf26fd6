"""The CRDs: generated from the spec schema, self-explaining, and as strict as the local validator.

`kubectl explain experiment.spec` should teach the API, `kubectl get exp`
should answer the first question, and a spec the cluster accepts should be one
`autolab apply` accepts too (and the other way round).
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path

import jsonschema
import pytest
import yaml

from controller.core.spec import DIFF_MAX_BYTES, NAME_MAX, SpecError, validate_document
from controller.kube.crds import experiment_crd, lab_crd, render

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


def schema_of(crd: dict) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def crd_validator(crd: dict) -> jsonschema.Validator:
    # The API server validates against the openAPIV3Schema; jsonschema reads the same keywords
    # (type, required, enum, pattern, maxLength, minimum, ...) and ignores x-kubernetes-*.
    return jsonschema.Draft7Validator(schema_of(crd))


def test_crds_on_disk_are_what_the_spec_schema_renders():
    rendered = render()
    on_disk = {p.name for p in (REPO / "crds").iterdir() if p.suffix == ".yaml"}
    assert on_disk == set(rendered), "crds/ holds files `autolab crds` does not write"
    for name, text in rendered.items():
        assert (REPO / "crds" / name).read_text() == text, (
            f"crds/{name} is stale: run `autolab crds` after changing controller/core/spec.py")


@pytest.mark.parametrize("crd", [experiment_crd(), lab_crd()], ids=["Experiment", "Lab"])
def test_every_field_says_what_it_is_for_kubectl_explain(crd):
    missing = []

    def walk(node: dict, path: str) -> None:
        for key, sub in (node.get("properties") or {}).items():
            if path == crd["spec"]["names"]["kind"] and key == "metadata":
                # A CRD may not describe metadata (only restrict name and generateName):
                # kubectl explain shows ObjectMeta's own description.
                walk(sub, f"{path}.{key}")
                continue
            if not sub.get("description"):
                missing.append(f"{path}.{key}")
            walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    assert schema_of(crd).get("description")
    walk(schema_of(crd), crd["spec"]["names"]["kind"])
    assert not missing, f"fields without a description: {missing}"


def test_kubectl_get_shows_phase_outcome_metric_and_master():
    def columns(crd: dict, wide: bool = False) -> list[str]:
        return [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]
                if wide or not c.get("priority")]

    assert columns(experiment_crd()) == ["Phase", "Outcome", "val_bpb", "Delta", "Campaign", "Age"]
    assert columns(experiment_crd(), wide=True)[-2:] == ["Lab", "Hypothesis"]  # -o wide
    assert columns(lab_crd()) == ["Metric", "Master", "Best", "Running", "Detectable", "Age"]
    for crd, short in ((experiment_crd(), "exp"), (lab_crd(), "lab")):
        version = crd["spec"]["versions"][0]
        assert crd["spec"]["group"] == "autolab.dev" and version["name"] == "v1alpha1"
        assert crd["spec"]["scope"] == "Namespaced"
        assert crd["spec"]["names"]["shortNames"] == [short]
        assert version["subresources"] == {"status": {}}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_experiments_are_valid_for_the_cluster_and_for_autolab_apply(path):
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    errors = [e.message for e in crd_validator(experiment_crd()).iter_errors(doc)]
    assert not errors, f"{path.name}: {errors}"
    validate_document(doc, source=str(path), kind="Experiment")


def test_example_experiments_apply_to_the_current_master(tmp_path):
    """Their diffs and parents are the real bench/train.py's, so a user can apply them as they are.

    When bench/train.py changes, `AUTOLAB_REWRITE_EXAMPLES=1 pytest tests/test_crds.py` writes
    each example's edit again against it (same lines changed, new context and parent).
    """
    import os

    from controller.local import init_lab
    from controller.core.spec import ExperimentSpec

    assert EXAMPLES, "manifests/examples/ has no Experiment"
    if os.environ.get("AUTOLAB_REWRITE_EXAMPLES") == "1":
        for path in EXAMPLES:
            _rewrite_example(path, (REPO / "bench" / "train.py").read_text())
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    for path in EXAMPLES:
        doc = yaml.safe_load(path.read_text())
        c = lab.repo.materialise(doc["metadata"]["name"], ExperimentSpec.from_dict(doc["spec"]))
        assert c.refusal is None, (
            f"{path.name} no longer applies to bench/train.py ({c.reason}: {c.message}); "
            "rewrite it with AUTOLAB_REWRITE_EXAMPLES=1 pytest tests/test_crds.py")


def _rewrite_example(path: Path, source: str) -> None:
    from controller.core.hashing import candidate_hash

    doc = yaml.safe_load(path.read_text())
    lines = doc["spec"]["diff"].splitlines()
    removed = [x[1:] for x in lines if x.startswith("-") and not x.startswith("---")]
    added = [x[1:] for x in lines if x.startswith("+") and not x.startswith("+++")]
    changed = source
    for old, new in zip(removed, added, strict=True):
        assert old in source, f"{path.name}: {old!r} is gone from bench/train.py; edit it by hand"
        changed = changed.replace(old, new, 1)
    diff = "".join(difflib.unified_diff(source.splitlines(True), changed.splitlines(True),
                                        "a/train.py", "b/train.py"))
    # A blank context line is " "; written as "" it keeps the YAML a readable literal block
    # (the diff checks read an empty line in a hunk as blank context).
    doc["spec"]["diff"] = _Literal("\n".join(x if x.strip() else "" for x in diff.split("\n")))
    doc["spec"]["parent"] = candidate_hash(source)[:12]
    head = path.read_text().split("\n", 1)[0]
    dumper = yaml.SafeDumper
    dumper.add_representer(_Literal, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v,
                                                                     style="|"))
    path.write_text(head + "\n" + yaml.dump(doc, Dumper=dumper, sort_keys=False, width=100,
                                            allow_unicode=True))


class _Literal(str):
    """A string YAML writes as a literal block (the diff stays readable)."""


def test_the_default_lab_is_valid():
    doc = yaml.safe_load((REPO / "manifests" / "lab.yaml").read_text())
    assert not [e.message for e in crd_validator(lab_crd()).iter_errors(doc)]
    validate_document(doc, source="manifests/lab.yaml", kind="Lab")


GOOD = yaml.safe_load(EXAMPLES[0].read_text()) if EXAMPLES else {}


def _broken(change) -> dict:
    doc = copy.deepcopy(GOOD)
    change(doc)
    return doc


INVALID = {
    "missing hypothesis": lambda d: d["spec"].pop("hypothesis"),
    "missing diff": lambda d: d["spec"].pop("diff"),
    "empty hypothesis": lambda d: d["spec"].update(hypothesis=""),
    "diff too large": lambda d: d["spec"].update(diff="+" * (DIFF_MAX_BYTES + 1)),
    "bad name": lambda d: d["metadata"].update(name="Warmdown_0.3"),
    "name too long": lambda d: d["metadata"].update(name="x" * 51),
    "parent not a hash": lambda d: d["spec"].update(parent="HEAD~1"),
    "gpus not a number": lambda d: d["spec"].update(resources={"gpus": "two"}),
    "too many gpus": lambda d: d["spec"].update(resources={"gpus": 64}),
    "priority not an integer": lambda d: d["spec"].update(priority=1.5),
    "unknown backend": lambda d: d["spec"].update(backend="slurm"),
    "campaign not a label": lambda d: d["spec"].update(campaign="Schedule Tuning"),
}


@pytest.mark.parametrize("what", list(INVALID), ids=list(INVALID))
def test_invalid_specs_are_refused_by_the_crd_schema_and_by_autolab_apply(what):
    doc = _broken(INVALID[what])
    assert list(crd_validator(experiment_crd()).iter_errors(doc)), f"the CRD accepts: {what}"
    with pytest.raises(SpecError):
        validate_document(doc, source="spec.yaml", kind="Experiment")


def test_an_experiment_spec_is_immutable_and_a_lab_spec_is_not():
    """An Experiment is one measured run of one diff; a Lab's budget and capacity are tuned."""
    def rules(crd: dict) -> list[dict]:
        return schema_of(crd)["properties"]["spec"].get("x-kubernetes-validations") or []

    (rule,) = rules(experiment_crd())
    assert rule["rule"] == "self == oldSelf"
    assert "create a new Experiment with a new metadata.name" in rule["message"]
    assert rules(lab_crd()) == []


@pytest.mark.parametrize("crd", [experiment_crd(), lab_crd()], ids=["Experiment", "Lab"])
def test_metadata_restricts_only_the_name_as_the_api_server_allows(crd):
    meta = schema_of(crd)["properties"]["metadata"]
    assert set(meta) == {"type", "properties"} and meta["type"] == "object"
    assert set(meta["properties"]) == {"name"}
    assert meta["properties"]["name"]["maxLength"] == NAME_MAX


def test_diff_size_limit_is_the_same_in_the_crd_and_the_validator():
    diff = schema_of(experiment_crd())["properties"]["spec"]["properties"]["diff"]
    assert diff["maxLength"] == DIFF_MAX_BYTES
    fits = _broken(lambda d: d["spec"].update(diff="".join(difflib.unified_diff(
        ["a\n"], ["b\n"], "a/train.py", "b/train.py"))))
    assert not list(crd_validator(experiment_crd()).iter_errors(fits))
