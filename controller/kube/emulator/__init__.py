"""An API server in this process, close enough to a real one that `kubectl` cannot tell.

The operator is tested (and benchmarked) against real HTTP, the real kopf and
the real `kubernetes` client, and users try the README's cluster section with
the real `kubectl`; only the API server is a stand-in. It is built on kmock's
`KubernetesEmulator` (its HTTP server, its catalogue of the built-in
resources, its request records) but answers every request itself, the way the
Kubernetes API server does:

- **paths**: core (`/api/v1/...`) and group (`/apis/G/V/...`) resources,
  namespaced and cluster-scoped (`/api/v1/namespaces/NAME` is a Namespace,
  `/api/v1/namespaces/NS/pods/NAME/log` a Pod's log), their `status`
  subresource, discovery (`/api`, `/apis`, `/version`) and OpenAPI:
  `/openapi/v3` with one document per group-version (`/openapi/v3/apis/G/V`)
  and `/openapi/v2` (JSON), built from the CRDs' schemas, so `kubectl apply`
  validates on the server and `kubectl explain` reads the descriptions;
- **verbs**: get, list, watch, create, update (PUT), patch (merge, JSON and
  a strategic merge for the built-in kinds), delete, deletecollection, with
  `dryRun=All`, `labelSelector` (equality and set-based) and `fieldSelector`
  (`metadata.name`/`metadata.namespace` everywhere, `involvedObject.*` on
  Events, `spec.nodeName`/`status.phase` on Pods, ...);
- **objects** carry `apiVersion` and `kind` (lists too: `ExperimentList`),
  and `uid`, `creationTimestamp`, `generation` and a `resourceVersion` that
  changes on every write that changes something (a no-op write changes
  nothing and wakes no watch, as on a real server);
- **optimistic concurrency**: an update or patch naming a stale
  `metadata.resourceVersion` is refused with 409 Conflict (the master
  promotion's compare-and-swap relies on it); a PUT of a custom resource must
  name one;
- **status subresource**: where a CRD declares it, writes to the object keep
  the stored `.status`, writes to `/status` keep everything but `.status`,
  and `generation` moves only when something outside metadata and status
  changes;
- **deletion**: an object with finalizers gets `deletionTimestamp` at once
  (a MODIFIED event, so the operator's finalizer runs now, not at its next
  resync); the write that removes the last finalizer removes the object
  (DELETED); without finalizers a delete is immediate. `kubectl delete`
  then waits with a list and watch of that one name, which is why lists
  carry `kind` and honour `fieldSelector` (kmock's did neither, and kubectl
  backed off for seconds). Deleting a Namespace deletes what is in it,
  deleting a CRD deletes its objects;
- **custom resources are admitted as a real server admits them**: fields
  the schema does not know (outside `x-kubernetes-preserve-unknown-fields`)
  are pruned, and reported per `fieldValidation` (Strict: 400 `strict
  decoding error: unknown field "spec.foo"`; Warn, the default: a `Warning`
  header; Ignore); `default`s are filled in; the openAPIV3Schema is enforced
  (types, enum, pattern, lengths, bounds, required: 422 Invalid with the
  causes kubectl prints); `x-kubernetes-validations` are enforced for the
  rule forms this emulator evaluates (today `self == oldSelf`, the
  Experiment's immutable spec; a CRD with any other rule is refused when it
  is created, rather than accepted and left unchecked). A CRD's root
  `metadata` may restrict only `name` and `generateName`, as on a real server;
- **annotations** of any object hold 256 KiB at most, keys and values
  together (422 Invalid `metadata.annotations: Too long`);
- **watches** start after the `resourceVersion` a client listed and lose
  nothing in between (a version older than the server's event log answers
  410 Gone, and the client lists again); a watch filtered by selectors sees
  an object that stops matching as DELETED; `timeoutSeconds` ends it;
- **tables**: a client that asks for `as=Table;v=v1;g=meta.k8s.io` (kubectl
  get, also with -w) gets rows: the CRD's `additionalPrinterColumns` (their
  jsonPaths evaluated here; kubectl shows the priority>0 ones only with
  `-o wide`), and for the built-in kinds the columns `kubectl get` shows on
  a real cluster (Pods: READY, STATUS, RESTARTS; Jobs: STATUS, COMPLETIONS;
  Events: LAST SEEN, TYPE, REASON, OBJECT, MESSAGE; ...);
- **protobuf** request bodies of the kinds kubectl's typed clients send
  that way (`kubectl create namespace|configmap|secret`) are read; every
  answer is JSON, which all clients accept;
- Pod logs (`pods/NAME/log`) come from `logs[(namespace, name)]`, which a
  test fills in to play the kubelet.

Left out, each the job of something other than the API server or not used
here: garbage collection of owned objects (the controller manager's), the
Job and Pod controllers (tests play the kubelet), server-side apply
(`kubectl apply --server-side`: 415), other protobuf bodies (`kubectl create
job`: 415; `kubectl apply -f` sends JSON), protobuf OpenAPI v2, admission
webhooks, authentication, RBAC, CEL beyond the rule forms above, schemas of
the built-in kinds (no `kubectl explain pod`; their writes are not
schema-checked), a Namespace that must exist before objects are made in it,
and `limit`/`continue` paging (every list is one page).

`python -m controller.kube.emulator [--port N]` serves one on localhost and
prints its URL (the operator benchmark runs it in its own process that way).

The package, floor by floor (each module imports only from those above it in this list):

- `model`: the words every layer shares: a resource's key, a request taken apart (`Call`),
  a served CRD version (`Crd`), a refusal (`ApiError`);
- `selectors`, `patches`, `admission`, `tables`, `protobuf`: pure functions over objects:
  label and field selectors; merge, JSON and strategic merge patches; what the server does to
  an object before it stores it (pruning, defaults, the schema, the rules); `kubectl get`'s
  rows; the protobuf bodies kubectl sends;
- `store`: the storage layer: the objects, their resourceVersions, the event log, and every
  write (create, update, patch, delete, finalizers, namespaces, a CRD's own resources);
- `watch`: the watch layer: a stream of the event log from a resourceVersion on;
- `discovery`: what the server says it serves: `/api`, `/apis`, resource lists and OpenAPI;
- `server`: the HTTP layer: the `Emulator` itself (the store, watches and discovery behind
  kmock's HTTP server), taking each request apart and answering it.
"""

from controller.kube.emulator.model import ApiError
from controller.kube.emulator.server import Emulator, main, serve

__all__ = ["ApiError", "Emulator", "main", "serve"]
