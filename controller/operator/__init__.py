"""The Kubernetes operator: kopf handlers that hand every Experiment and Lab to the engine.

    runtime.py   one Lab as the cluster sees it: the engine's seams (statuses in the custom
                 resources, the master ConfigMap, Kubernetes Events) and its LabRuntime
    handlers.py  the Operator: its passes over an Experiment and a Lab, the kopf handlers,
                 and `register()`, which puts them into a kopf registry

It is the cluster's front end to the same engine as the local loop
(`controller.engine`, which makes every decision). This module adapts it to
a cluster and decides nothing about an experiment's lifecycle itself:
statuses live in the custom resources (`ClusterStatuses`), the master in the
ConfigMap `<lab>-master` with the lab repo kept in step (`ClusterMaster`),
events are Kubernetes Events and the Lab's status mirrors the master
(`ClusterEvents`). Create, update, resume, the timer for runs in flight, the
Job and Pod watches and the finalizer all call the one engine pass.

    kopf event (create | update | resume | timer | Job/Pod change | delete)
        -> GET the Experiment (the handler's copy may lag our own writes)
        -> its Lab's engine: observe, reconcile(), act, until nothing is left
        -> kopf: a known failure is permanent until the object changes; others retry

An Experiment's place in the queue comes from its `metadata.creationTimestamp`
(`core/slots.py`: priority, then creation time, as Kueue orders workloads). The
API server stamps it in whole seconds, so Experiments created in the same second
(one `kubectl apply -f DIR`) are queued in name order: the name is the last
tie-break, and only there. The Lab's `status.queue` lists the experiments that
wait for a slot, in the order they get one.

A Lab's handlers keep what the cluster side of a lab needs: its directory on
the operator's volume (`$AUTOLAB_LAB_DIR/<lab>`: the lab repo with worktrees and
branches, the ledger; created with `autolab init`'s code when missing), the
master ConfigMap `<lab>-master` (the master of record, created from the lab
repo the first time), the master's baseline run (a Job too) and the Lab's
status, which mirrors the master and counts the runs in flight.

Events are told the Kubernetes way, once per fact: each is named after what it
tells (`<object>.<16 hex>`: the object's uid with, for an Experiment, the
status its transition leaves and the reason; for a Lab, the reason and the
message) and posted by the operator itself before the status that records it.
An operator that dies in between makes the same transition again on its next
pass and posts the same name again, which the API server refuses with 409
AlreadyExists: the story in `kubectl describe` loses nothing and repeats
nothing. An Event that cannot be posted fails the pass (before its status is
written); kopf retries it.

Log lines about one object carry kopf's `[namespace/name]` prefix (the
`k8s_ref` kopf's own per-object lines carry; `configure_logging` puts kopf's
prefixing formatter on the operator's log, as `kopf run` does).

Deleting an Experiment runs the finalizer: a run in flight is cancelled (its
Job deleted), the cancellation is recorded in the ledger, and the finalizer
goes when the engine's pass says `finalized`. Jobs and Pods the operator creates
carry ownerReferences and the `app.kubernetes.io/managed-by=autolab` label,
and the operator watches only those.

Run it with `autolab operator` (see `--help`), or `python -m
controller.cli.operator` (what the Deployment does: the same flags, and the
image needs neither torch nor the other commands' extras). Importing this
module registers nothing and is cheap: kopf and the Kubernetes client load
only when an operator starts, and `register()` puts the handlers into the
registry it is given.
"""

from controller.operator.handlers import Operator, register
from controller.operator.runtime import (HANDLER_WORKERS, ClusterEvents, ClusterMaster,
                                        ClusterStatuses, LabMissing, LabRuntime, LabUnusable,
                                        OperatorConfig, configure_logging)

__all__ = ["HANDLER_WORKERS", "ClusterEvents", "ClusterMaster", "ClusterStatuses", "LabMissing",
           "LabRuntime", "LabUnusable", "Operator", "OperatorConfig", "configure_logging",
           "register"]
