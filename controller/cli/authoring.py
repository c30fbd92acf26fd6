"""Writing specs: the authoring commands people and coding agents share.

Most experiments are written by coding agents. This module gives them (and
people) the same four steps the controller expects, and the commands that
render the roles that drive a lab into each agent runtime (`agents`).

Authoring a spec:

- `autolab worktree NAME` checks out the current master under
  `.autolab/scratch/NAME` (a detached git worktree) and remembers which
  master it started from. Edit the surface there.
- `autolab new NAME --hypothesis ...` diffs that worktree's surface against
  the master it started from and prints the Experiment (or writes it to
  `experiments/drafts/` with `-w`; `experiments/` itself is the controller's
  live set, so an unchecked draft never lands there by accident).
- `autolab validate FILE...` runs every check the controller makes before a
  run, offline, through the controller's own code: the schema
  (`validate_document`), the diff, its parent, apply or rebase and compile
  (`LabRepo.materialise`, into a throwaway worktree that is removed
  afterwards), the duplicate search (`LocalLab.duplicate_of`), and then the
  pure `reconcile()` itself, so the phase, reason and message it prints are
  the ones the controller would record. Nothing recorded changes.

The role contracts of the agents, and their renderings into each runtime, are in
`agents`; the commands here (`autolab agents render|list`, `autolab kickoff`) use them.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from controller.cli import output as cli
from controller.cli.agents import AGENTS_DIR, RUNTIMES, kickoff_text, load_contracts, render
from controller.core.spec import (API_VERSION, ExperimentSpec, SpecError, is_valid_name,
                                  validate_document)
from controller.lab.clock import utcnow
from controller.lab.files import atomic_write
from controller.lab.git import GitError
from controller.lab.memory import near_duplicates
from controller.lab.paths import find_lab_root
from controller.local import LocalLab, load_yaml_file


# ============================================================================================
# Scratch worktrees and drafting a spec
# ============================================================================================

class Scratch:
    """A scratch checkout of a master, where a person or an agent edits the surface.

    It is a detached git worktree under `.autolab/scratch/<name>`; beside it,
    `.<name>.json` remembers the master (hash and commit) it was made from, which
    becomes the spec's parent whatever the worktree's HEAD does later.
    """

    def __init__(self, lab: LocalLab, name: str):
        if not is_valid_name(name):
            raise cli.CliError(f"{name!r} is not a valid name: use a lowercase DNS label "
                               "(a-z, 0-9, '-'), at most 50 characters")
        self.lab = lab
        self.name = name
        self.path = lab.state / "scratch" / name
        self.meta_path = lab.state / "scratch" / f".{name}.json"

    def exists(self) -> bool:
        return self.path.exists() and self.meta_path.exists()

    def base(self) -> dict:
        if not self.exists():
            raise cli.CliError(f"no scratch worktree {self.name!r}; create it with "
                               f"`autolab worktree {self.name}`, edit {self.lab.lab.surface} "
                               "there, then run `autolab new` again")
        return json.loads(self.meta_path.read_text())

    def create(self) -> Path:
        m = self.lab.repo.master()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lab.repo.git("worktree", "add", "--quiet", "--detach", str(self.path), m.commit)
        atomic_write(self.meta_path, json.dumps({"hash": m.hash, "commit": m.commit,
                                                 "createdAt": utcnow()}, indent=2) + "\n")
        return self.path

    def remove(self) -> None:
        if self.path.exists():
            self.lab.repo.git("worktree", "remove", "--force", str(self.path), check=False)
        if self.path.exists():
            import shutil
            shutil.rmtree(self.path, ignore_errors=True)
        self.lab.repo.git("worktree", "prune", check=False)
        self.meta_path.unlink(missing_ok=True)

    def diff(self) -> str:
        """The surface in the worktree (committed or not) against the master it came from."""
        surface = self.lab.lab.surface
        out = self.lab.repo.git("diff", "--no-color", "--no-ext-diff", "--src-prefix=a/",
                                "--dst-prefix=b/", self.base()["commit"], "--", surface,
                                cwd=self.path).stdout
        return out

    def other_changes(self) -> list[str]:
        """Paths other than the surface that differ from the base (they will not be sent)."""
        surface = self.lab.lab.surface
        changed = self.lab.repo.git("diff", "--name-only", self.base()["commit"],
                                    cwd=self.path).stdout.split()
        untracked = self.lab.repo.git("ls-files", "--others", "--exclude-standard",
                                      cwd=self.path).stdout.split()
        return sorted(p for p in set(changed) | set(untracked) if p != surface)


def list_scratches(lab: LocalLab) -> list[tuple[str, dict]]:
    d = lab.state / "scratch"
    if not d.exists():
        return []
    return [(p.name[1:-5], json.loads(p.read_text())) for p in sorted(d.glob(".*.json"))]


def _literal_yaml(doc: dict) -> str:
    """The spec as YAML with the diff as a literal block, which people and agents can read.

    PyYAML refuses block style for text with trailing spaces (an empty context line
    of a diff is one space), so the diff is written by hand and the result is checked
    by parsing it back; anything that would not round-trip falls back to PyYAML's
    quoted form.
    """
    spec = dict(doc["spec"])
    diff = spec.pop("diff")
    head = yaml.safe_dump({**doc, "spec": spec}, sort_keys=False, width=100,
                          allow_unicode=True)
    if "\r" not in diff and diff.endswith("\n") and not diff.endswith("\n\n"):
        body = "".join("    " + line for line in diff.splitlines(True))
        text = head + "  diff: |2\n" + body
        try:
            if yaml.safe_load(text) == doc:
                return text
        except yaml.YAMLError:
            pass
    return yaml.safe_dump(doc, sort_keys=False, width=100, allow_unicode=True)


def draft_spec(lab: LocalLab, name: str, hypothesis: str, campaign: str | None,
               scratch: Scratch) -> dict:
    """The Experiment for the edits in `scratch`, checked against the schema."""
    diff = scratch.diff()
    if not diff.strip():
        raise cli.CliError(f"{scratch.path / lab.lab.surface} does not differ from the master "
                           f"{scratch.base()['hash'][:12]} it was made from; make the change "
                           "there first")
    spec: dict[str, Any] = {"lab": lab.name}
    if campaign:
        spec["campaign"] = campaign
    spec.update(hypothesis=" ".join(hypothesis.split()), parent=scratch.base()["hash"][:12],
                diff=diff)
    doc = {"apiVersion": API_VERSION, "kind": "Experiment", "metadata": {"name": name},
           "spec": spec}
    return validate_document(doc, source=f"autolab new {name}", kind="Experiment")


# ============================================================================================
# validate: the controller's pre-run checks, offline
# ============================================================================================

@dataclass
class Finding:
    """What the controller would decide about one spec before any run."""

    file: str
    name: str | None
    ok: bool
    phase: str
    reason: str
    message: str
    candidateHash: str | None = None
    parentHash: str | None = None
    rebasedFrom: str | None = None
    duplicateOf: str | None = None
    notes: list[str] = field(default_factory=list)


class Validator:
    """Runs the controller's own checks on spec files against one lab, changing nothing.

    The candidate is materialised under a name no experiment can have (it holds a
    '.' and an '_'), so it never touches a real experiment's worktree or branch,
    and is removed afterwards whatever happens. Specs that pass join the in-flight
    index, so a batch that repeats itself is caught the way the controller would.
    """

    def __init__(self, lab: LocalLab):
        self.lab = lab
        self.seen: dict[str, str] = {}
        self._n = 0
        self._changes: dict[str, dict[str, str]] = {}
        lab.engine.observe_all([(n, lab.read_record(n).get("status") or {}, 0, "")
                                for n in lab.names()])

    def _scratch_name(self) -> str:
        import os
        self._n += 1
        return f"_validate.{os.getpid()}.{self._n}"

    def files(self, paths: list[str]) -> list[Finding]:
        out: list[Finding] = []
        for p in paths:
            path = Path(p)
            files = sorted(f for f in path.iterdir() if f.suffix in (".yaml", ".yml")) \
                if path.is_dir() else [path]
            for f in files:
                try:
                    docs = load_yaml_file(f)
                except SpecError as e:
                    out.append(Finding(str(f), None, False, "Invalid", "InvalidSpec", str(e)))
                    continue
                if not docs:
                    out.append(Finding(str(f), None, False, "Invalid", "InvalidSpec",
                                       f"{f}: no Experiment in the file"))
                for doc in docs:
                    out.append(self.document(doc, str(f)))
        return out

    def document(self, doc: Any, source: str) -> Finding:
        meta = doc.get("metadata") if isinstance(doc, dict) else None
        name = meta.get("name") if isinstance(meta, dict) else None
        name = name if isinstance(name, str) and name else None
        spec: ExperimentSpec | None = None
        spec_error: str | None = None
        try:
            validate_document(doc, source=source, kind="Experiment")
            spec = ExperimentSpec.from_dict(doc["spec"])
        except SpecError as e:
            spec_error = str(e)
        except (KeyError, TypeError, AttributeError) as e:
            spec_error = f"{source}: spec: {e}"
        if spec_error or name is None:
            return self._decide(source, name or "unnamed", spec, spec_error or
                                f"{source}: metadata.name: required field is missing")
        taken = self._name_taken(name, doc, source)
        if taken:
            return Finding(source, name, False, "Invalid", "NameTaken", taken)
        self.seen[name] = source
        return self._decide(source, name, spec, None, self._scratch_name())

    def _name_taken(self, name: str, doc: dict, source: str) -> str | None:
        if name in self.seen:
            return (f"{source}: metadata.name {name!r} is already used by {self.seen[name]}; "
                    "names must be unique")
        record = self.lab.read_record(name)
        if record:
            phase = (record.get("status") or {}).get("phase", "Pending")
            if record.get("spec") != doc.get("spec"):
                return (f"experiment {name!r} already exists (phase {phase}) with a different "
                        "spec; the controller runs the spec it checked and ignores changes. "
                        "Apply this one under a new name")
            return None
        return self.lab.engine.name_refusal(name)

    def _decide(self, source: str, name: str, spec: ExperimentSpec | None,
                spec_error: str | None, scratch: str | None = None) -> Finding:
        st = self.lab.engine.dry_run(name, spec, spec_error, scratch)
        checked = next((c for c in st.get("conditions", []) if c["type"] == "Checked"), None)
        ok = st["phase"] not in ("Invalid", "Duplicate", "Conflict")
        f = Finding(source, name, ok, st["phase"], checked["reason"] if checked else st["reason"],
                    checked["message"] if checked else st["message"],
                    candidateHash=st.get("candidateHash"), parentHash=st.get("parentHash"),
                    rebasedFrom=st.get("rebasedFrom"), duplicateOf=st.get("duplicateOf"))
        record = self.lab.read_record(name)
        if ok and record:
            # Applied but not yet checked by the controller: no phase recorded, which is Pending.
            phase = (record.get("status") or {}).get("phase") or "Pending"
            f.notes.append(f"already applied: phase {phase}")
        if ok and self.lab.repo.master().val_bpb is None:
            f.notes.append("the master has no measured val_bpb yet; its baseline runs first")
        if ok and spec is not None and st["phase"] != "Duplicate":
            for near in near_duplicates(self.lab.repo, self.lab.ledger.rows(), spec.diff, name,
                                        self._changes):
                f.notes.append(f"near-duplicate: {near}")
        return f


def validate_paths(lab: LocalLab, paths: list[str]) -> list[Finding]:
    return Validator(lab).files(paths)


# ============================================================================================
# Commands
# ============================================================================================

def open_lab(path: str) -> LocalLab:
    """The lab at `path`; from inside a scratch worktree (a checkout of the lab), the lab itself."""
    return LocalLab(find_lab_root(path) or Path(path).resolve())


def cmd_worktree(a) -> int:
    lab = open_lab(a.lab)
    if not a.name:
        rows = [[n, meta["hash"][:12], meta.get("createdAt", ""),
                 str(lab.state / "scratch" / n)] for n, meta in list_scratches(lab)]
        cli.print_table(["NAME", "PARENT", "CREATED", "PATH"], rows)
        return 0
    s = Scratch(lab, a.name)
    if a.rm:
        s.remove()
        print(f"removed {s.path}", file=sys.stderr)
        return 0
    if not s.exists():
        if s.path.exists():
            raise cli.CliError(f"{s.path} exists but is not a scratch worktree Autolab made; "
                               f"remove it or pick another name")
        s.create()
    else:
        m = lab.repo.master()
        base = s.base()
        if base["hash"] != m.hash:
            print(f"note: the master moved from {base['hash'][:12]} to {m.hash[:12]} since this "
                  "worktree was made; `autolab validate` tells whether the diff still rebases, "
                  f"or start afresh with `autolab worktree {a.name} --rm`", file=sys.stderr)
    print(s.path)
    return 0


def cmd_new(a) -> int:
    lab = open_lab(a.lab)
    if not is_valid_name(a.name):
        raise cli.CliError(f"{a.name!r} is not a valid experiment name: use a lowercase DNS "
                           "label (a-z, 0-9, '-'), at most 50 characters")
    scratch = Scratch(lab, a.worktree or a.name)
    doc = draft_spec(lab, a.name, a.hypothesis, a.campaign, scratch)
    others = scratch.other_changes()
    if others:
        print(f"note: {scratch.path} also changes {', '.join(others)}; only "
              f"{lab.lab.surface} goes into the experiment", file=sys.stderr)
    m = lab.repo.master()
    if scratch.base()["hash"] != m.hash:
        print(f"note: written against {scratch.base()['hash'][:12]}; the master is now "
              f"{m.hash[:12]}: the controller rebases the diff if it applies cleanly "
              "(`autolab validate` tells)", file=sys.stderr)
    text = _literal_yaml(doc)
    target = Path(a.output) if a.output else (
        lab.experiments_dir / "drafts" / f"{a.name}.yaml" if a.write else None)
    if target is None:
        sys.stdout.write(text)
        return 0
    if target.exists() and not a.force:
        raise cli.CliError(f"{target} exists; pass --force to replace it")
    atomic_write(target, text)
    print(target)
    return 0


def cmd_validate(a) -> int:
    lab = open_lab(a.lab)
    try:
        findings = validate_paths(lab, a.filename)
    except GitError as e:
        raise cli.CliError(f"the lab repo could not materialise a candidate: {e}") from None
    if a.output == "json":
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            head = f"{f.file}: {f.name or '?'}: "
            if f.ok:
                print(head + f"ok ({f.message})")
            else:
                print(head + f"{f.phase} ({f.reason}): {f.message}")
            for n in f.notes:
                print(f"  note: {n}")
    return 0 if findings and all(f.ok for f in findings) else 1


def _lab_or_none(path: str) -> LocalLab | None:
    try:
        return open_lab(path)
    except SpecError:
        return None


def cmd_agents_render(a) -> int:
    runtimes = list(RUNTIMES) if "all" in a.runtime else list(dict.fromkeys(a.runtime))
    slots = a.gpu_slots
    if slots is None:
        lab = _lab_or_none(a.out)
        slots = len(_slots(lab)) if lab else 1
    for rel, verb in render(runtimes, Path(a.out), gpu_slots=slots,
                            source=Path(a.source) if a.source else AGENTS_DIR):
        print(f"{rel} {verb}")
    return 0


def cmd_agents_list(a) -> int:
    rows = [[c.name, ",".join(c.capabilities), c.description[:80]]
            for c in load_contracts(Path(a.source) if a.source else AGENTS_DIR)]
    cli.print_table(["ROLE", "CAPABILITIES", "DESCRIPTION"], rows)
    return 0


def _slots(lab: LocalLab) -> list[str]:
    from controller.backends.local import visible_slots
    return visible_slots(lab.lab.gpu_slots)


def cmd_kickoff(a) -> int:
    lab = _lab_or_none(a.lab)
    slots = a.gpu_slots if a.gpu_slots is not None else (len(_slots(lab)) if lab else 1)
    if slots < 1:
        raise cli.CliError("--gpu-slots must be at least 1")
    sys.stdout.write(kickoff_text(a.runtime, slots, lab=lab))
    return 0


def cmd_report(a) -> int:
    from controller.lab.report import write_report
    lab = open_lab(a.lab)
    md, png = write_report(lab, stuck_after=a.stuck_after, png=not a.no_png)
    sys.stdout.write(md)
    if png:
        print(f"\n(progress chart: {png})", file=sys.stderr)
    return 0


def cmd_dashboard(a) -> int:
    from controller.lab import tracking
    lab = open_lab(a.lab)
    tracking.sync(lab.root, lab.name, quiet=False)
    if a.sync_space or a.sync_bucket:
        return tracking.push(lab.root, lab.name, space_id=a.sync_space, bucket_id=a.sync_bucket)
    return tracking.show(lab.root, lab.name, host=a.host, port=a.port, open_browser=not a.no_browser)


def add_commands(sub: argparse._SubParsersAction, add: Callable) -> None:
    sp = add("worktree", cmd_worktree, "a scratch checkout of the master to edit (prints its "
                                       "path); no NAME lists them")
    sp.add_argument("name", nargs="?")
    sp.add_argument("--rm", action="store_true", help="remove the scratch worktree")

    sp = add("new", cmd_new, "the Experiment spec for the edits in a scratch worktree")
    sp.add_argument("name", help="the experiment's name (new, never reused)")
    sp.add_argument("--hypothesis", required=True, help="one sentence: the change and why")
    sp.add_argument("--campaign", help="campaign grouping related experiments")
    sp.add_argument("--worktree", help="scratch worktree to diff (default: NAME)")
    sp.add_argument("-w", "--write", action="store_true",
                    help="write experiments/drafts/NAME.yaml instead of printing")
    sp.add_argument("-o", "--output", metavar="FILE", help="write the spec to FILE")
    sp.add_argument("--force", action="store_true", help="replace an existing file")

    sp = add("validate", cmd_validate, "every pre-run check of the controller, offline; exit "
                                       "code 0 when all specs would be queued")
    sp.add_argument("filename", nargs="+", help="spec files or directories")
    sp.add_argument("-o", "--output", choices=["text", "json"], default="text")

    agents = add("agents", None, "role contracts for coding agents", lab=False)
    agents.set_defaults(fn=lambda a: (agents.print_help(), 1)[1])
    asub = agents.add_subparsers(dest="agents_command", metavar="SUBCOMMAND")
    rp = asub.add_parser("render", help="write each runtime's native agent files from agents/")
    rp.add_argument("--for", dest="runtime", action="append", required=True,
                    choices=[*RUNTIMES, "all"], help="runtime (repeatable, or all)")
    rp.add_argument("--out", default=".", help="project directory to write into (default: .)")
    rp.add_argument("--gpu-slots", type=int, help="concurrency cap written where a runtime "
                                                  "has one (default: the lab's slots, or 1)")
    rp.add_argument("--source", help="directory of role contracts (default: agents/)")
    rp.set_defaults(fn=cmd_agents_render)
    lp = asub.add_parser("list", help="the role contracts")
    lp.add_argument("--source", help="directory of role contracts (default: agents/)")
    lp.set_defaults(fn=cmd_agents_list)

    sp = add("kickoff", cmd_kickoff, "print the parent session's prompt")
    sp.add_argument("--gpu-slots", type=int, help="GPU slots (default: the lab's)")
    sp.add_argument("--for", dest="runtime", choices=RUNTIMES, default="opencode")

    sp = add("report", cmd_report, "progress report: markdown and research/live/progress.png")
    sp.add_argument("--stuck-after", type=float, default=None, metavar="SECONDS",
                    help="a run longer than this is stuck (default: 3x the budget, or 30 min)")
    sp.add_argument("--no-png", action="store_true", help="skip the chart")

    sp = add("dashboard", cmd_dashboard, "open the lab's Trackio dashboard")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=int, default=None)
    sp.add_argument("--no-browser", action="store_true")
    sp.add_argument("--sync-space", metavar="USER/SPACE",
                    help="push the lab's runs to a Hugging Face Space instead of serving")
    sp.add_argument("--sync-bucket", metavar="USER/BUCKET",
                    help="with --sync-space: the bucket that stores the Space's data")
