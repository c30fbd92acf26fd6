"""`autolab operator`, and `python -m controller.cli.operator` (the Deployment's entry point).

Both build the same flags here and run the same kopf operator; this module imports
nothing heavier than kopf, so the operator image needs neither torch nor the other
commands' extras. Nothing registers at import time: `register()` puts the handlers
into the registry that `kopf.run` is given.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def default_namespace() -> str:
    env = os.environ.get("AUTOLAB_NAMESPACE") or os.environ.get("POD_NAMESPACE")
    if env:
        return env
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return sa.read_text().strip() if sa.exists() else "autolab"


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--namespace", default=default_namespace(),
                    help="namespace to watch (default: $AUTOLAB_NAMESPACE, the pod's, or autolab)")
    sp.add_argument("--lab-dir", default=os.environ.get("AUTOLAB_LAB_DIR", "/var/lib/autolab"),
                    help="where lab repos and ledgers live, one directory per Lab "
                         "(default: $AUTOLAB_LAB_DIR or /var/lib/autolab)")
    sp.add_argument("--peering", default="autolab",
                    help="KopfPeering object to coordinate replicas through (default: autolab)")
    sp.add_argument("--standalone", action="store_true",
                    help="no peering: only safe with exactly one operator")
    sp.add_argument("--priority", type=int, default=0, help="peering priority")
    sp.add_argument("--liveness", default=None, metavar="URL",
                    help="serve kopf's health endpoint, e.g. http://0.0.0.0:8080/healthz")
    sp.add_argument("--resync", type=float, default=float(os.environ.get(
        "AUTOLAB_RESYNC_SECONDS", "30")), help="seconds between passes over runs in flight")
    sp.add_argument("--run-image", default=os.environ.get("AUTOLAB_RUN_IMAGE"),
                    help="run image for Labs that name none (default: $AUTOLAB_RUN_IMAGE)")
    sp.add_argument("--server", default=os.environ.get("AUTOLAB_KUBE_SERVER"),
                    help="plain-HTTP API server URL (an emulator: python -m "
                         "controller.kube.emulator); default: in-cluster config, else the "
                         "kubeconfig")
    sp.add_argument("--no-scanning", action="store_true",
                    default=os.environ.get("AUTOLAB_KOPF_SCANNING", "1") == "0",
                    help="do not watch namespaces and CRDs (no ClusterRole needed; the CRDs must "
                         "exist before the operator starts)")
    sp.add_argument("-v", "--verbose", action="store_true")


def cmd_operator(a: Any) -> int:
    import kopf

    from controller.operator import Operator, OperatorConfig, configure_logging, register

    config = OperatorConfig(lab_root=Path(a.lab_dir), resync_seconds=a.resync,
                            server=a.server, run_image=a.run_image,
                            scanning=not a.no_scanning)
    configure_logging(verbose=a.verbose)  # kopf's [namespace/name] prefix, as `kopf run`
    registry = register(Operator(config), kopf.OperatorRegistry())
    # A peering name makes peering mandatory in kopf: name it only when there is peering.
    kopf.run(registry=registry, namespaces=[a.namespace], standalone=a.standalone,
             peering_name=None if a.standalone else a.peering, priority=a.priority,
             liveness_endpoint=a.liveness)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m controller.cli.operator",
                                description="the Autolab Kubernetes operator")
    add_arguments(p)
    return cmd_operator(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
