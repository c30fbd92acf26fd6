"""The install: `kubectl kustomize` renders crds/ and manifests/ into what a cluster needs.

Rendered with the real kustomize (kubectl's built-in one, or a `kustomize`
binary). kubectl 1.14+ carries kustomize, so no cluster is needed to render.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]


def kustomize(directory: Path) -> list[dict]:
    if shutil.which("kubectl"):
        cmd = ["kubectl", "kustomize", str(directory)]
    elif shutil.which("kustomize"):
        cmd = ["kustomize", "build", str(directory)]
    else:
        pytest.skip("neither kubectl nor kustomize is installed (apt-get install kubectl)")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"{' '.join(cmd)} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@pytest.fixture(scope="module")
def base() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in kustomize(REPO / "manifests")}


def test_crds_render_with_kopf_peering():
    kinds = {(d["kind"], d["metadata"]["name"]) for d in kustomize(REPO / "crds")}
    assert kinds == {("CustomResourceDefinition", "experiments.autolab.dev"),
                     ("CustomResourceDefinition", "labs.autolab.dev"),
                     ("CustomResourceDefinition", "kopfpeerings.kopf.dev")}


def test_base_has_everything_the_operator_needs_in_its_namespace(base):
    assert set(base) == {
        ("Namespace", "autolab"), ("ServiceAccount", "autolab-operator"),
        ("Role", "autolab-operator"), ("RoleBinding", "autolab-operator"),
        ("ClusterRole", "autolab-operator-scanning"),
        ("ClusterRoleBinding", "autolab-operator-scanning"),
        ("PersistentVolumeClaim", "autolab-labs"), ("PersistentVolumeClaim", "autolab-cache"),
        ("KopfPeering", "autolab"), ("Deployment", "autolab-operator"), ("Lab", "default")}
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for (kind, name), doc in base.items():
        if kind not in cluster_scoped:
            assert doc["metadata"].get("namespace") == "autolab", f"{kind}/{name}"


def test_operator_deployment_runs_kopf_with_peering_and_a_liveness_probe(base):
    dep = base[("Deployment", "autolab-operator")]["spec"]
    assert dep["replicas"] == 1 and dep["strategy"]["type"] == "Recreate"
    pod = dep["template"]["spec"]
    assert pod["serviceAccountName"] == "autolab-operator"
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/autolab/autolab-operator:0.1.0"
    assert "--liveness=http://0.0.0.0:8080/healthz" in c["args"]
    assert "--peering=autolab" in c["args"] and ("KopfPeering", "autolab") in base
    probe = c["livenessProbe"]["httpGet"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}[probe["port"]]
    assert (probe["path"], port) == ("/healthz", 8080)
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]}
    assert mounts["labs"] == env["AUTOLAB_LAB_DIR"]["value"]
    assert ("PersistentVolumeClaim", claims["labs"]) in base


def test_deployment_args_are_flags_of_the_images_entry_point():
    """The image runs `python -m controller.cli.operator`; the Deployment's args must be its flags."""
    import argparse

    from controller.cli import operator

    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["python", "-m", "controller.cli.operator"]' in dockerfile
    dep = yaml.safe_load((REPO / "manifests" / "operator.yaml").read_text())
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    operator.add_arguments(parser)
    parser.parse_args([a.replace("$(POD_NAMESPACE)", "autolab") for a in args])


def test_rbac_names_verbs_and_resources_without_wildcards(base):
    for kind in ("Role", "ClusterRole"):
        for (k, _), doc in base.items():
            if k != kind:
                continue
            for rule in doc["rules"]:
                assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"]
    scanning = base[("ClusterRole", "autolab-operator-scanning")]["rules"]
    assert {(g, r) for rule in scanning for g in rule["apiGroups"] for r in rule["resources"]} == {
        ("", "namespaces"), ("apiextensions.k8s.io", "customresourcedefinitions")}
    assert all(set(rule["verbs"]) <= {"list", "watch"} for rule in scanning)
    for binding in ("RoleBinding", "ClusterRoleBinding"):
        (subject,) = [doc for (k, _), doc in base.items() if k == binding][0]["subjects"]
        assert (subject["kind"], subject["name"], subject["namespace"]) == (
            "ServiceAccount", "autolab-operator", "autolab")


def test_default_lab_runs_on_kubernetes_with_the_shared_cache(base):
    lab = base[("Lab", "default")]["spec"]
    assert lab["backend"] == "kubernetes"
    assert ("PersistentVolumeClaim", lab["kubernetes"]["cachePVC"]) in base
