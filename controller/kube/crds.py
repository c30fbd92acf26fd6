"""The CustomResourceDefinitions, generated from the spec schemas in `controller.core.spec`.

`autolab crds` writes `crds/experiment.yaml` and `crds/lab.yaml`; a test
checks that the files in the repo equal what this module renders, so the CRDs
and the local validator cannot drift apart. Beside them go kopf's namespaced
`KopfPeering` CRD (operators hand over through it) and a kustomization, so
`kubectl apply -k crds/` installs every CRD the operator needs.

Beyond the schema, the API server enforces two things here: an Experiment's
spec cannot change once applied (`x-kubernetes-validations: self == oldSelf`;
a Lab's spec stays mutable, since its budget, capacity and image are meant to
be tuned), and a name must be a short DNS label (`metadata.name` pattern and
maxLength: the only part of metadata a CRD may restrict).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from controller.core.spec import (EXPERIMENT_SPEC, GROUP, LAB_SPEC, NAME_MAX, NAME_PATTERN, VERSION,
                                  crd_schema)

NAME_DESCRIPTION = {
    "Experiment": "A lowercase DNS label of at most 50 characters; it names the run's Job "
                  "(exp-<name>-1) and labels its Pods.",
    "Lab": "A lowercase DNS label of at most 50 characters; it names the master ConfigMap "
           "(<name>-master) and the lab's directory on the operator's volume.",
}

STATUS_DESCRIPTION = ("What the controller observed; written by the controller only "
                      "(status subresource).")

EXPERIMENT_STATUS = {
    "type": "object", "description": STATUS_DESCRIPTION,
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "phase": {"type": "string", "description": "Pending, Invalid, Duplicate, Conflict, "
                                                   "Queued, Running, Confirming, Succeeded, Failed or "
                                                   "Cancelled."},
        "outcome": {"type": "string", "description": "Promoted, Rejected or Undecided (not a "
                                                     "measured rejection), once Succeeded."},
        "reason": {"type": "string", "description": "CamelCase reason of the last transition."},
        "message": {"type": "string", "description": "The last transition, for a person."},
        "candidateHash": {"type": "string", "description": "SHA-1 of the normalised candidate."},
        "semanticHash": {"type": "string", "description": "SHA-1 of the candidate's AST."},
        "parentHash": {"type": "string", "description": "Master hash the candidate ran against."},
        "rebasedFrom": {"type": "string", "description": "Master hash the diff was written "
                                                         "against, when it was rebased."},
        "duplicateOf": {"type": "string", "description": "What this candidate repeats."},
        "delta": {"type": "number", "description": "val_bpb minus the master's (negative is "
                                                   "better)."},
        "metrics": {"type": "object", "description": "The run's summary metrics.",
                    "x-kubernetes-preserve-unknown-fields": True},
        "selfReported": {"type": "array", "items": {"type": "string"},
                         "description": "The metrics that are the candidate's own word (its "
                                        "stats.json), not measured by the harness."},
        "job": {"type": "object", "description": "The run: backend, name, slot, place, id.",
                "x-kubernetes-preserve-unknown-fields": True},
        "pairs": {"type": "object", "description": "The decision: the candidate's and the "
                                                   "master's val_bpb at each place, the places "
                                                   "where the master ran first, the estimate "
                                                   "(gain, interval, t) and the verdict.",
                  "x-kubernetes-preserve-unknown-fields": True},
        "tries": {"type": "integer", "description": "Which test against its master this "
                                                    "decision is."},
        "level": {"type": "number", "description": "The level of this decision's test, kept "
                                                   "when it began (the campaign's online FDR "
                                                   "control, LORD++)."},
        "lostRuns": {"type": "array", "description": "Runs lost for a reason outside the "
                                                     "candidate and run again at their place: "
                                                     "run, base, program, place, state, "
                                                     "reason, at.",
                     "items": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        "continues": {"type": "array", "items": {"type": "string"},
                      "description": "The unfinished decisions of the same candidate on the same "
                                     "master whose pairs this one took."},
        "conditions": {"type": "array", "description": "Checked, Scheduled, Running, Promoted.",
                       "items": {"type": "object",
                                 "x-kubernetes-preserve-unknown-fields": True}},
        "observedGeneration": {"type": "integer", "description": "Generation last reconciled."},
    },
}

LAB_STATUS = {
    "type": "object", "description": STATUS_DESCRIPTION,
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "master": {"type": "object", "description": "The current master: hash, val_bpb, "
                                                    "experiment, promotedAt.",
                   "x-kubernetes-preserve-unknown-fields": True},
        "running": {"type": "integer", "description": "Runs in flight."},
        "queue": {"type": "array", "items": {"type": "string"},
                  "description": "The Experiments waiting for a slot, in the order they get one "
                                 "(priority, then creation time; a decision's pair runs one "
                                 "experiment at a time)."},
        "noise": {"type": "object", "nullable": True,
                  "description": "What `autolab noise` measured on the current master (master): "
                                 "the spread across seeds (acrossSeeds), of the same seed twice "
                                 "(paired), the smallest gain detected (detectable) within the "
                                 "cap of pairs, budgetSeconds, measuredAt.",
                  "x-kubernetes-preserve-unknown-fields": True},
    },
}


def _crd(kind: str, plural: str, short: str, spec: dict, status: dict, columns: list) -> dict:
    schema = crd_schema({
        "type": "object",
        "description": f"An Autolab {kind}.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "autolab.dev/v1alpha1"},
            "kind": {"type": "string", "description": kind},
            # A CRD may restrict only metadata.name and generateName, and nothing else of
            # metadata (not even its description: kubectl explain shows ObjectMeta's).
            "metadata": {"type": "object",
                         "properties": {"name": {
                             "type": "string", "pattern": NAME_PATTERN, "maxLength": NAME_MAX,
                             "description": NAME_DESCRIPTION[kind]}}},
            "spec": spec,
            "status": status,
        },
    })
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                      "shortNames": [short], "listKind": f"{kind}List"},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": schema},
            }],
        },
    }


# An Experiment is one measured run of one diff: a changed spec would make its status, its Job
# and its ledger row describe something it no longer says. The API server refuses the change.
IMMUTABLE_SPEC = [{
    "rule": "self == oldSelf",
    "message": "the spec of an Experiment cannot change once applied (it is one measured run of "
               "one diff); to try something else, create a new Experiment with a new "
               "metadata.name",
}]


def experiment_crd() -> dict:
    spec = {**EXPERIMENT_SPEC, "x-kubernetes-validations": IMMUTABLE_SPEC}
    return _crd("Experiment", "experiments", "exp", spec, EXPERIMENT_STATUS, [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Outcome", "type": "string", "jsonPath": ".status.outcome"},
        {"name": "val_bpb", "type": "number", "jsonPath": ".status.metrics.val_bpb"},
        {"name": "Delta", "type": "number", "jsonPath": ".status.delta"},
        {"name": "Campaign", "type": "string", "jsonPath": ".spec.campaign"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        # priority 1: kubectl shows these with -o wide only
        {"name": "Lab", "type": "string", "jsonPath": ".spec.lab", "priority": 1},
        {"name": "Hypothesis", "type": "string", "jsonPath": ".spec.hypothesis", "priority": 1},
    ])


def lab_crd() -> dict:
    return _crd("Lab", "labs", "lab", LAB_SPEC, LAB_STATUS, [
        {"name": "Metric", "type": "string", "jsonPath": ".spec.metric"},
        {"name": "Master", "type": "string", "jsonPath": ".status.master.hash"},
        {"name": "Best", "type": "number", "jsonPath": ".status.master.val_bpb"},
        {"name": "Running", "type": "integer", "jsonPath": ".status.running"},
        {"name": "Detectable", "type": "number", "jsonPath": ".status.noise.detectable"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ])


def kopf_peering_crd() -> dict:
    """kopf's namespaced peering resource: running operators announce themselves in its status."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "kopfpeerings.kopf.dev"},
        "spec": {
            "group": "kopf.dev",
            "scope": "Namespaced",
            "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "Where kopf operators of one namespace see each other, so only "
                                   "the one with the highest priority acts.",
                    "properties": {"status": {
                        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
                        "description": "One entry per running operator: its priority and when "
                                       "it was last seen."}},
                }},
            }],
        },
    }


def render() -> dict[str, str]:
    header = "# Generated by `autolab crds` from controller/core/spec.py; do not edit by hand.\n"
    docs = (("experiment.yaml", experiment_crd()), ("lab.yaml", lab_crd()),
            ("kopf-peering.yaml", kopf_peering_crd()),
            ("kustomization.yaml", {"apiVersion": "kustomize.config.k8s.io/v1beta1",
                                    "kind": "Kustomization",
                                    "resources": ["experiment.yaml", "lab.yaml",
                                                  "kopf-peering.yaml"]}))
    return {name: header + yaml.safe_dump(doc, sort_keys=False, width=100) for name, doc in docs}


def write_crds(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in render().items():
        (out / name).write_text(text)
        paths.append(out / name)
    return paths
