"""The Experiment and Lab specs: one schema, used everywhere.

The schemas below are the single source of truth for what a user may write.
The local front end validates spec files against them, the CRDs in `crds/`
are generated from them (`autolab crds`), and the tests check that the files
on disk still match, so the cluster and the laptop can never disagree.

Validation is strict: unknown fields, wrong kinds and wrong types are refused
with the file, the field and what is expected. Kubernetes structural schemas
cannot say `additionalProperties: false` next to `properties`, so the CRD
rendering drops those markers and relies on the API server's field pruning
and `kubectl`'s strict field validation instead.

Spec strings travel far: into git's argv and stdin, commit messages, file
names, the ledger's TSV, status files, Events and people's terminals. So
before the schema is consulted every string (and every field name) is checked
to be printable Unicode: a NUL byte would cut git's argv short, ESC starts a
terminal escape sequence, and a lone surrogate (what a YAML `"\\ud800"` escape
makes) is not a character at all and cannot be written as UTF-8. The
multi-line fields (the hypothesis, the diff, annotations) may also hold
newlines and tabs, and a carriage return only as part of a CRLF line end (the
diff parser turns CRLF into LF, so git never sees one). A diff may not hold
bidirectional controls or Unicode line separators either: they make it read
differently from the program git applies ("Trojan Source"). A refusal names
the field, the line and column, and the fix.

A document is also bounded (values, nesting) and made of JSON's types only,
so YAML aliases cannot expand a few lines into millions of values and a YAML
date cannot reach a JSON status file. `trackable` says whether a spec file
can be tracked as an experiment at all, even an Invalid one: its name keys
files (status, lock, events, notes), so a name that is not a DNS label names
no experiment, as the Kubernetes API server would refuse the object.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from controller.core.errors import InputError, MachineError
from controller.core.noise import FIRST_LOOK, MAX_PAIRS, NOISE_RUNS

GROUP = "autolab.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Names become branch names, Job names (`exp-<name>-<attempt>`, <= 63 chars)
# and label values, so they are DNS labels with room for the prefixes.
NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAME_MAX = 50
HASH_PREFIX_PATTERN = r"^[0-9a-f]{4,40}$"
DIFF_MAX_BYTES = 128 * 1024
BACKENDS = ("local", "kubernetes", "hf")


def _s(description: str, **kw: Any) -> dict:
    return {"type": "string", "description": description, **kw}


def _i(description: str, **kw: Any) -> dict:
    return {"type": "integer", "description": description, **kw}


def _obj(description: str, properties: dict, required: tuple = (), **kw: Any) -> dict:
    out = {"type": "object", "description": description, "properties": properties,
           "additionalProperties": False, **kw}
    if required:
        out["required"] = list(required)
    return out


HF_OVERRIDES = _obj("Hugging Face Jobs settings for this run; each overrides the Lab's.", {
    "flavor": _s("Hardware flavor, e.g. h200, a100-large, l4x1.", pattern=r"^[a-z0-9][-a-z0-9]*$"),
    "timeout": _s("Job timeout, e.g. 30m or 1h.", pattern=r"^[0-9]+[smhd]?$"),
    "namespace": _s("User or organisation that owns the job."),
})

EXPERIMENT_SPEC = _obj(
    "What the experiment changes and why: one hypothesis, one diff against the surface.",
    {
        "lab": _s("Name of the Lab this experiment belongs to.", pattern=NAME_PATTERN,
                  maxLength=NAME_MAX, default="default"),
        "campaign": _s("Campaign grouping related experiments (a label-safe name).",
                       pattern=r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?)?$", maxLength=63),
        "hypothesis": _s("One sentence: what the change should do to val_bpb, and why.",
                         minLength=1, maxLength=2000),
        "parent": _s("Master hash (or a unique prefix of at least 4 hex digits) the diff "
                     "was written against.", pattern=HASH_PREFIX_PATTERN),
        "diff": _s("Unified diff against the surface (bench/train.py or train.py). "
                   "Only the surface may change.", minLength=1, maxLength=DIFF_MAX_BYTES),
        "backend": _s("Where the run executes; default: the Lab's.", enum=list(BACKENDS)),
        "resources": _obj("Resources for the run.", {
            "gpus": _i("GPUs for the run (0 runs on the CPU).", minimum=0, maximum=8, default=1),
        }),
        "priority": _i("Higher runs first when GPU slots are scarce.", minimum=-1000,
                       maximum=1000, default=0),
        "hf": HF_OVERRIDES,
    },
    required=("hypothesis", "parent", "diff"),
)

LAB_SPEC = _obj(
    "The benchmark being optimised: surface, harness, metric, budget, capacity, promotion "
    "policy and backend defaults.",
    {
        "surface": _s("Path of the one file experiments may change.", default="bench/train.py"),
        "harness": _s("Path of the fixed harness that nobody changes.", default="bench/prepare.py"),
        "metric": _s("Metric read from the run result; lower is better.", enum=["val_bpb"],
                     default="val_bpb"),
        "profile": _s("Benchmark profile: default (CUDA) or tiny (CPU, seconds).",
                      enum=["default", "tiny"], default="default"),
        "budgetSeconds": _i("Training-time budget of one run, in seconds.", minimum=1,
                            maximum=86400),
        "data": _s("Data source for prepare: hub, synthetic or dir:PATH.",
                   pattern=r"^(hub|synthetic|dir:.+)$", default="hub"),
        "capacity": _obj("How many runs may execute at once.", {
            "gpuSlots": _i("Concurrent runs; 0 means one per visible GPU (one on a CPU).",
                           minimum=0, maximum=1024, default=0),
        }),
        "promotion": _obj("When a finished candidate replaces the master: paired runs "
                          "(the candidate and the master on the same secret harness seeds), "
                          "judged after each pair by a sequential one-sided t-test.", {
            "minDelta": {
                "description": "The smallest gain worth promoting: the candidate's mean gain "
                               "over its pairs must be above it. auto (the default): any gain "
                               "the test shows real. A number with confirmRuns unsaid: one "
                               "pair decides (for labs that know their noise).",
                "default": "auto",
                # A number or "auto". A structural CRD schema cannot say "number or string",
                # so the CRD keeps this field untyped (crd_schema drops the anyOf) and the
                # operator validates it with the whole schema.
                "x-kubernetes-preserve-unknown-fields": True,
                "anyOf": [{"type": "number", "minimum": 0},
                          {"type": "string", "enum": ["auto"]}]},
            "maxPairs": _i("The most pairs one decision may take (each pair: one run of the "
                           "candidate, and one of the master where the master has no value "
                           f"at that seed yet). Default {MAX_PAIRS}.", minimum=FIRST_LOOK,
                           maximum=50),
            "confirmRuns": _i("Kept from earlier labs. 0: one pair decides (against minDelta). "
                              "N > 0: the sequential test with at most N + 1 pairs, where "
                              "maxPairs is unsaid.", minimum=0, maximum=49),
            "noiseRuns": _i("Seeds `autolab noise` measures the master on (and repeats): the "
                            "spread across seeds, the spread of paired differences, and the "
                            "smallest gain the lab detects. Decisions never wait for it.",
                            minimum=2, maximum=50, default=NOISE_RUNS),
        }),
        "backend": _s("Default backend for experiments.", enum=list(BACKENDS), default="local"),
        "kubernetes": _obj("Settings of the Kubernetes Job backend.", {
            "image": _s("Container image holding bench/ (see bench/Dockerfile)."),
            "cachePVC": _s("PersistentVolumeClaim holding the data and compile caches."),
            "queue": _s("Kueue LocalQueue; when set, Jobs are created suspended for Kueue."),
            "priorityClassName": _s("PriorityClass for run Pods."),
            "nodeSelector": {"type": "object", "description": "Node labels run Pods require.",
                             "additionalProperties": {"type": "string"}},
            "tolerations": {"type": "array", "description": "Tolerations for run Pods.",
                            "items": {"type": "object",
                                      "x-kubernetes-preserve-unknown-fields": True}},
            "backoffLimit": _i("Retries of a Pod lost to the infrastructure.", minimum=0,
                               maximum=10, default=2),
        }),
        "hf": _obj("Settings of the Hugging Face Jobs backend.", {
            "flavor": _s("Hardware flavor, e.g. h200.", default="h200"),
            "namespace": _s("User or organisation that owns the jobs."),
            "bucket": _s("Bucket holding the prepared data cache, mounted at the cache dir."),
            "timeout": _s("Job timeout, e.g. 30m.", pattern=r"^[0-9]+[smhd]?$", default="30m"),
            "image": _s("Docker image the job runs in."),
            "tokenSecret": _s("In a cluster: the Secret (key HF_TOKEN) holding the token."),
        }),
    },
)


def document_schema(kind: str, spec_schema: dict, extra_required: tuple = ()) -> dict:
    """The schema of a whole spec file (apiVersion, kind, metadata, spec)."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec", *extra_required],
        "properties": {
            "apiVersion": {"const": API_VERSION},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": NAME_PATTERN, "maxLength": NAME_MAX},
                    "namespace": {"type": "string"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "annotations": {"type": "object",
                                    "additionalProperties": {"type": "string"}},
                },
            },
            "spec": spec_schema,
        },
    }


SCHEMAS = {"Experiment": document_schema("Experiment", EXPERIMENT_SPEC),
           "Lab": document_schema("Lab", LAB_SPEC)}


def crd_schema(schema: dict) -> dict:
    """The schema as Kubernetes wants it: structural, without additionalProperties: false."""
    out = copy.deepcopy(schema)

    def strip(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("additionalProperties") is False:
                del node["additionalProperties"]
            if node.get("x-kubernetes-preserve-unknown-fields") and "anyOf" in node:
                del node["anyOf"]  # typed alternatives: not structural (see minDelta)
                node.pop("default", None)
            for v in node.values():
                strip(v)
        elif isinstance(node, list):
            for v in node:
                strip(v)

    strip(out)
    return out


class SpecError(InputError, ValueError):
    """A spec that cannot be accepted; the message names where and what to fix."""


class SpecUnreadable(MachineError, SpecError):
    """A spec, or a record the controller keeps of one (master.json, a status file), that the
    machine could not read or that something damaged: nothing the user wrote is at fault.
    Still a SpecError, so every place that reports a spec's problem against its experiment
    reports this one there too; its kind is the machine's."""


def _where(path: list | tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


# --- the text a spec may carry ------------------------------------------------------------------

MAX_VALUES = 10_000  # values in one spec document; a real one has a few dozen
MAX_DEPTH = 32  # nesting of mappings and lists
_TOO_MANY = (f"the document holds more than {MAX_VALUES} values (YAML aliases that repeat a "
             "list?); a spec is a few dozen")
_SURROGATES = "\ud800-\udfff"
_PATTERNS = {
    # one line of printable text: names, hashes, labels, settings
    "line": re.compile(f"[\x00-\x1f\x7f-\x9f{_SURROGATES}]"),
    # several lines: newline and tab too, CR only in a CRLF line end
    "text": re.compile(f"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f{_SURROGATES}]|\r(?!\n)"),
    # a diff: text, without what makes it read differently from what git applies
    "diff": re.compile(f"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f{_SURROGATES}"
                       "\u202a-\u202e\u2066-\u2069\u2028\u2029]|\r(?!\n)"),
}
_TEXT_FIELDS = {("spec", "hypothesis"): "text", ("spec", "diff"): "diff"}
_CONTROL_NAMES = {0x00: "a NUL byte (U+0000)", 0x07: "the bell character (U+0007)",
                  0x08: "a backspace (U+0008)", 0x09: "a tab (U+0009)",
                  0x0A: "a line break (U+000A)", 0x0D: "a carriage return (U+000D)",
                  0x1B: "the escape character (U+001B)", 0x7F: "the delete character (U+007F)"}


def _describe(ch: str, kind: str) -> tuple[str, str, str]:
    """What the character is, why that matters (may be empty), and how to fix the text."""
    cp = ord(ch)
    fix = ("remove it (the field is one line of printable text)" if kind == "line"
           else "remove it (only printable text, newlines and tabs are allowed)")
    if 0xD800 <= cp <= 0xDFFF:
        return (f"a lone surrogate (U+{cp:04X})", "which is not a Unicode character",
                "write the character itself, not a \\uXXXX escape (use \\UXXXXXXXX in YAML "
                "for characters beyond U+FFFF)")
    if 0x202A <= cp <= 0x202E or 0x2066 <= cp <= 0x2069:
        return (f"the bidirectional control U+{cp:04X}",
                "which makes a diff read differently from the code it applies", "remove it")
    if cp in (0x2028, 0x2029):
        return (f"the Unicode {'line' if cp == 0x2028 else 'paragraph'} separator U+{cp:04X}",
                "which makes a diff read differently from the code it applies",
                "use a plain newline")
    if cp == 0x0D and kind != "line":
        return "a carriage return (U+000D)", "which is not part of a CRLF line end", fix
    return _CONTROL_NAMES.get(cp, f"the control character U+{cp:04X}"), "", fix


def unsafe_character(text: str, kind: str = "line") -> str | None:
    """The first character `text` may not hold, as a phrase naming it, where, and the fix.

    kind: "line" (one line of printable text), "text" (newlines and tabs too, CR only in
    CRLF) or "diff" (text, without bidirectional controls and Unicode line separators).
    The phrase reads `contains <what> at <where>[, <why>]; <fix>`.
    """
    m = _PATTERNS[kind].search(text)
    if m is None:
        return None
    what, why, fix = _describe(m.group()[0], kind)
    at = (f"character {m.start() + 1}" if kind == "line"
          else text_position(text, m.start()))
    return f"contains {what} at {at}{', ' + why if why else ''}; {fix}"


def text_position(text: str, offset: int) -> str:
    """`line L, column C` (1-based) of a character offset."""
    line = text.count("\n", 0, offset) + 1
    column = offset - text.rfind("\n", 0, offset)  # rfind is -1 on the first line
    return f"line {line}, column {column}"


def _text_kind(path: tuple) -> str:
    if path[:2] == ("metadata", "annotations") and len(path) == 3:
        return "text"
    return _TEXT_FIELDS.get(path, "line")


def _type_name(x: Any) -> str:
    return type(x).__name__


def _scan(doc: Any) -> tuple[list[str], str | None]:
    """(the text problems, the shape problem) of a parsed document; walks at most MAX_VALUES.

    A shape problem (too many values, too deep, not JSON's types) means the document cannot
    even be kept; text problems mean it can be kept but not accepted.
    """
    problems: list[str] = []
    shape: str | None = None
    stack: list[tuple[tuple, Any]] = [((), doc)]
    seen = 0
    while stack:
        path, node = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            return problems, _TOO_MANY
        where = _where(path)
        if len(path) > MAX_DEPTH:
            return problems, f"{_where(path[:3])}: nested more than {MAX_DEPTH} levels deep"
        if isinstance(node, dict):
            children = []
            for k, v in node.items():
                if not isinstance(k, str):
                    shape = shape or (f"{where}: field names must be text, got "
                                      f"{_type_name(k)} {ascii(k)[:60]}")
                    continue
                bad = unsafe_character(k, "line")
                if bad:
                    problems.append(f"{where}: a field name {bad}")
                    continue
                children.append((path + (k,), v))
            stack.extend(reversed(children))
        elif isinstance(node, list):
            if seen + len(node) > MAX_VALUES:
                return problems, _TOO_MANY
            stack.extend(reversed([(path + (i,), v) for i, v in enumerate(node)]))
        elif isinstance(node, str):
            bad = unsafe_character(node, _text_kind(path))
            if bad:
                problems.append(f"{where}: {bad}")
        elif node is not None and not isinstance(node, (bool, int, float)):
            shape = shape or (f"{where}: expected text, a number, true/false, a list or a "
                              f"mapping, got {_type_name(node)} {ascii(str(node))[1:-1][:60]} "
                              "(quote it to make it text)")
    return problems, shape


def trackable(doc: Any) -> bool:
    """Whether a spec document can be tracked as an experiment at all, even an Invalid one.

    Its name keys the experiment's files (status, lock, events, notes), so it must be a
    DNS label; and a copy of it is kept as JSON, so it must be bounded and of JSON's types.
    A document that fails this names no experiment: its file is reported instead.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("metadata"), dict):
        return False
    name = doc["metadata"].get("name")
    return isinstance(name, str) and is_valid_name(name) and _scan(doc)[1] is None


def _show(x: Any, limit: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[:limit] + "..."


def _explain(err: jsonschema.ValidationError) -> str:
    where = _where(list(err.absolute_path))
    v = err.validator
    if v == "required":
        missing = err.message.split("'")[1]
        field = f"{where}.{missing}" if err.absolute_path else missing
        expect = err.schema.get("properties", {}).get(missing, {})
        hint = expect.get("description", "")
        return f"{field}: required field is missing" + (f" ({hint})" if hint else "")
    if v == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})), key=str)
        known = ", ".join(sorted(err.schema.get("properties", {})))
        prefix = f"{where}." if err.absolute_path else ""
        msg = f"{prefix}{extra[0]}: unknown field; expected one of: {known}"
        if extra and extra[0] == "status":
            msg += " (status is written by the controller; remove it from the spec)"
        return msg
    if v == "const":
        return f"{where}: expected {err.validator_value!r}, got {_show(err.instance)}"
    if v == "type":
        return (f"{where}: expected {err.validator_value}, got {type(err.instance).__name__} "
                f"{_show(err.instance)}")
    if v == "enum":
        return (f"{where}: expected one of {', '.join(map(str, err.validator_value))}, "
                f"got {_show(err.instance)}")
    if v == "pattern":
        what = "a lowercase DNS label (a-z, 0-9, '-')" if err.validator_value == NAME_PATTERN \
            else ("4 to 40 lowercase hex digits" if err.validator_value == HASH_PREFIX_PATTERN
                  else f"text matching {err.validator_value}")
        return f"{where}: expected {what}, got {_show(err.instance)}"
    if v in ("maxLength", "minLength"):
        n = len(err.instance) if isinstance(err.instance, str) else 0
        if v == "minLength":
            return f"{where}: must not be empty"
        return f"{where}: is {n} characters; at most {err.validator_value} allowed"
    if v in ("minimum", "maximum"):
        return f"{where}: {err.instance!r} is out of range ({v} {err.validator_value})"
    return f"{where}: {err.message}"


def validate_document(doc: Any, *, source: str = "spec", kind: str | None = None) -> dict:
    """Check a parsed spec file; returns it, or raises SpecError naming source and field."""
    if not isinstance(doc, dict):
        raise SpecError(f"{source}: expected a mapping with apiVersion, kind, metadata and spec, "
                        f"got {type(doc).__name__}")
    problems, shape = _scan(doc)
    if shape or problems:
        raise SpecError(f"{source}: " + "; ".join(([shape] if shape else []) + problems[:5]))
    k = kind or doc.get("kind")
    if k not in SCHEMAS:
        raise SpecError(f"{source}: kind: expected one of {', '.join(SCHEMAS)}, got {k!r}")
    errors = sorted(jsonschema.Draft202012Validator(SCHEMAS[k]).iter_errors(doc),
                    key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if errors:
        raise SpecError(f"{source}: " + "; ".join(_explain(e) for e in errors[:5]))
    return doc


@dataclass(frozen=True)
class ExperimentSpec:
    """An Experiment's spec, defaults filled in."""

    hypothesis: str
    parent: str
    diff: str
    lab: str = "default"
    campaign: str = ""
    backend: str | None = None
    gpus: int = 1
    priority: int = 0
    hf: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: dict) -> "ExperimentSpec":
        return cls(hypothesis=spec["hypothesis"].strip(), parent=spec["parent"], diff=spec["diff"],
                   lab=spec.get("lab", "default"), campaign=spec.get("campaign", ""),
                   backend=spec.get("backend"),
                   gpus=int(spec.get("resources", {}).get("gpus", 1)),
                   priority=int(spec.get("priority", 0)), hf=dict(spec.get("hf", {})))


@dataclass(frozen=True)
class LabSpec:
    """A Lab's spec, defaults filled in."""

    surface: str = "bench/train.py"
    harness: str = "bench/prepare.py"
    metric: str = "val_bpb"
    profile: str = "default"
    budget_seconds: int | None = None
    data: str = "hub"
    gpu_slots: int = 0
    min_delta: float | str = "auto"   # a number, or "auto" (see `one_pair_decides`)
    confirm_runs: int | None = None  # None: unsaid; 0: one pair decides; N: cap N + 1
    noise_runs: int = NOISE_RUNS
    max_pairs: int | None = None     # None: unsaid (confirmRuns + 1, else MAX_PAIRS)
    backend: str = "local"
    kubernetes: dict = field(default_factory=dict)
    hf: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: dict) -> "LabSpec":
        return cls(surface=spec.get("surface", "bench/train.py"),
                   harness=spec.get("harness", "bench/prepare.py"),
                   metric=spec.get("metric", "val_bpb"), profile=spec.get("profile", "default"),
                   budget_seconds=spec.get("budgetSeconds"), data=spec.get("data", "hub"),
                   gpu_slots=int(spec.get("capacity", {}).get("gpuSlots", 0)),
                   min_delta=_min_delta(spec.get("promotion", {}).get("minDelta", "auto")),
                   confirm_runs=_confirm_runs(spec.get("promotion", {}).get("confirmRuns")),
                   noise_runs=int(spec.get("promotion", {}).get("noiseRuns", NOISE_RUNS)),
                   max_pairs=_confirm_runs(spec.get("promotion", {}).get("maxPairs")),
                   backend=spec.get("backend", "local"),
                   kubernetes=dict(spec.get("kubernetes", {})), hf=dict(spec.get("hf", {})))


    @property
    def one_pair_decides(self) -> bool:
        """The lab lets one pair decide: `confirmRuns: 0`, or a number for minDelta with
        confirmRuns unsaid (as labs did before the sequential test)."""
        return self.confirm_runs == 0 or (self.min_delta != "auto" and self.confirm_runs is None
                                          and self.max_pairs is None)

    @property
    def pairs_cap(self) -> int:
        """The most pairs one decision may take."""
        if self.max_pairs is not None:
            return self.max_pairs
        if self.confirm_runs:
            return max(FIRST_LOOK, self.confirm_runs + 1)
        return MAX_PAIRS

    @property
    def min_gain(self) -> float:
        """What a gain must be above to be promoted (0 with auto)."""
        return 0.0 if self.min_delta == "auto" else float(self.min_delta)


def _min_delta(v: object) -> float | str:
    return "auto" if v == "auto" else float(v)  # type: ignore[arg-type]


def _confirm_runs(v: object) -> int | None:
    return None if v is None else int(v)  # type: ignore[call-overload]


def is_valid_name(name: str) -> bool:
    # fullmatch: `$` alone would let a trailing newline through
    return len(name) <= NAME_MAX and re.fullmatch(NAME_PATTERN, name) is not None


def next_name(name: str) -> str:
    """A name to suggest instead of a taken one: `warmdown-03` -> `warmdown-03-2`, `x-2` -> `x-3`."""
    head, _, tail = name.rpartition("-")
    if head and tail.isdigit() and len(tail) < 4:
        return f"{head}-{int(tail) + 1:0{len(tail)}d}"
    return f"{name}-2"
