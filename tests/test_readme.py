"""The README's and the docs' commands and specs, run as written (issues 14 and 38).

Every code block of README.md and of docs/*.md (fenced or indented) and every
manifests/examples/*.yaml is found here and meets one fate:

- a **command for one machine** (`autolab ...`, `cd`, `source`, `$EDITOR ...`) runs in bash,
  in page order (PAGES: the README, then the docs pages that continue its walk-through), in one shell whose `cd`, `source` and exports carry over from line to line,
  with a temporary HOME (so `cd ~ && autolab init mylab` makes a fresh lab there), and is held
  to what the text around it promises (the columns its comment names, "conditions, events, the
  diff", ...);
- a **cluster command** (`kubectl ...`, including the one each example names in its first line)
  runs against the API emulator with the operator running (tests/test_kubectl.py's emulator,
  tests/test_operator.py's operator and kubelet), verbatim but for the kubeconfig (KUBECONFIG);
- a **spec** (an Experiment in any page or in manifests/examples/, a Lab fragment) is checked by the controller's own code against a fresh lab: its `parent` is the seed
  master's hash, so an example left behind by a change of bench/train.py fails here;
- anything else is in NOT_RUN with the reason it cannot run here (a Docker daemon, the Hub, a
  picture that is not a command).

A block added to a page without one of these decisions fails
`test_every_block_of_the_readme_has_a_decision`, which says to classify it; and every
`autolab` command a page shows, run or not, must parse with autolab's own parser
(`test_every_autolab_command_the_pages_show_parses`).
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shlex
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml
from kubernetes import client as k8s

from controller.core.hashing import candidate_hash
from controller.core.spec import LabSpec, validate_document
from test_kubectl import KUBECTL, Api
from test_operator import CMS, JOBS, NS, Cluster, operator, result

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages whose blocks this file reads, in the order their commands run: the README, then the
# docs pages that go on from its lab (writing a spec, the agents), then the rest.
WALK_ON = ("experiments.md", "agents.md")
PAGES = [README, *(REPO / "docs" / name for name in WALK_ON),
         *(p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in WALK_ON)]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))
SEED_HASH = candidate_hash((REPO / "bench" / "train.py").read_text())
SHELLS = ("bash", "sh", "shell", "console", "indented")


# --- the README's blocks ------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    line: int      # 1-based line of the block's first line of content
    lang: str      # the fence's language, "" for a bare fence, "indented" for a 4-space block
    text: str      # dedented content
    section: str   # the heading above it
    page: Path = README

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def key(self) -> str:
        return self.text.strip().splitlines()[0].strip()


FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w-]*)\s*$")


def readme_blocks(text: str, page: Path = README) -> list[Block]:
    """Fenced blocks (at any indent, as in a list item) and CommonMark indented blocks (4 spaces
    after a blank line, outside a fence)."""
    lines = text.splitlines()
    out: list[Block] = []
    section, i = "", 0
    while i < len(lines):
        line = lines[i]
        if m := FENCE.match(line):
            indent, fence, lang = len(m[1]), m[2], m[3]
            start, body, i = i + 1, [], i + 1
            while i < len(lines) and lines[i].strip() != fence:
                body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
                i += 1
            out.append(Block(start + 1, lang, "\n".join(body), section, page))
            i += 1
            continue
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip()):
            start, body = i, []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            out.append(Block(start + 1, "indented", "\n".join(body).strip("\n"), section, page))
            continue
        i += 1
    return out


def split_comment(line: str) -> tuple[str, str]:
    """`cmd args  # comment` -> (cmd args, comment): a `#` after whitespace, outside quotes."""
    quote = ""
    for j, ch in enumerate(line):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (j == 0 or line[j - 1].isspace()):
            return line[:j].rstrip(), line[j + 1:].strip()
    return line.rstrip(), ""


@dataclass(frozen=True)
class Command:
    text: str      # what bash runs: the line as written, continuations joined
    command: str   # the same without its trailing comment: the key of its decision
    comment: str   # what the README says it does
    block: Block


def commands(block: Block) -> list[Command]:
    out, pending = [], ""
    for raw in block.text.splitlines():
        line = pending + raw
        if line.rstrip().endswith("\\"):  # a continuation: one command over two lines
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        command, comment = split_comment(line.strip())
        out.append(Command(line.strip(), " ".join(command.split()), comment, block))
    return out


def example_commands(path: Path) -> list[str]:
    """An example's first line names the commands that use it: `# kubectl ...; kubectl ...`."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# kubectl "), f"{path.name}: its first line should name its command"
    return [c.strip() for c in first[1:].split(";")]


BLOCKS = [b for page in PAGES for b in readme_blocks(page.read_text(), page)]


def shell_commands() -> list[Command]:
    return [c for b in BLOCKS if b.lang in SHELLS for c in commands(b)]


def experiment_blocks() -> list[Block]:
    return [b for b in BLOCKS if b.lang == "yaml" and "kind: Experiment" in b.text]


def lab_fragments() -> list[Block]:
    """YAML blocks that show part of a Lab: a top-level `spec:` and no kind."""
    return [b for b in BLOCKS if b.lang == "yaml" and "kind:" not in b.text
            and b.text.lstrip().startswith("spec:")]


# --- the decisions ------------------------------------------------------------------------------

# What this file does not run, and why it cannot run here. Keys: a command as written (without
# its comment), or the first line of a block that is not a command.
NOT_RUN = {
    "./dev demo": "runs for ~3 minutes; tests/test_local.py::test_demo_meets_every_outcome runs "
                  "the same demo (run_demo, what `./dev demo` execs as `autolab demo`)",
    "./dev test": "the test suite itself, of which this file is a part",
    "docker build -t REGISTRY/autolab-operator:0.1.0 .": "needs a Docker daemon and a registry "
                                                          "(REGISTRY is the reader's)",
    "docker build -t REGISTRY/autolab-bench:0.1.0 bench/": "needs a Docker daemon and a registry "
                                                           "(REGISTRY is the reader's)",
    "autolab dashboard": "serves Trackio's dashboard until Ctrl-C; --sync-space needs the Hub",
    "autolab kickoff | opencode run --agent autolab": "needs a model: "
        "tests/test_agent_sessions.py runs this session (the prompt on stdin) on a scripted one",
    'codex exec --trust "$(autolab kickoff --for codex)"': "needs a model: "
        "tests/test_agent_sessions.py runs `codex exec` with the kickoff prompt on a scripted one "
        "(the lab trusted in its CODEX_HOME's config instead of --trust)",
    '{"provider": {"mine": {"npm": "@ai-sdk/openai-compatible",': "the reader's model server; "
        "tests/test_agent_sessions.py gives OpenCode the same kind of provider for its scripted "
        "model",
    "Pending -> Invalid | Duplicate | Conflict                    (no GPU spent)":
        "the diagram of an experiment's phases, not a command",
    "Pending -> Invalid | Duplicate | Conflict                     (no GPU spent)":
        "docs/experiments.md's diagram of an experiment's phases, not a command",
    "you or an agent                         the controller (autolab run, or the operator)":
        "the README's picture of the loop, not a command",
    "cli            controller/cli/       `autolab`: one explicit parser (main.py) and its commands":
        "docs/architecture.md's picture of the floors, not a command",
    "bench/perf/gpu_throughput.sh 20 3 MKCORPUS losing": "needs a GPU machine and the corpus "
        "builder; its figures are in docs/results.md with the machine and the date",
    ".venv/bin/python bench/perf/lab_throughput.py --data synthetic --profile tiny --budget 5 "
    "--lab /tmp/tp": "a benchmark that prints figures (minutes on a CPU); the one-machine "
                     "walk-through above runs the same `autolab run` loop",
}

# One machine: each command the README shows, in order, and what its text promises. Each check
# gets the finished process and the test's context (the shell and its lab).
ON_ONE_MACHINE: dict[str, Callable[[subprocess.CompletedProcess, "Shell"], None]] = {}
# In a cluster: the same, against the emulator with the operator running.
IN_A_CLUSTER: set[str] = {
    "kubectl apply -k crds/",
    "kubectl wait --for condition=Established crd/experiments.autolab.dev crd/labs.autolab.dev "
    "crd/kopfpeerings.kopf.dev",
    "kubectl apply -k manifests/",
    "kubectl -n autolab rollout status deploy/autolab-operator",
    "kubectl -n autolab get lab",
    "kubectl explain experiment.spec",
    "kubectl apply -f manifests/examples/warmdown-03.yaml",
    "kubectl -n autolab get exp -w",
    "kubectl -n autolab describe exp warmdown-03",
    "kubectl -n autolab logs -f job/exp-warmdown-03-1",
    "kubectl -n autolab get cm default-master -o jsonpath='{.data.master\\.json}'",
}


def promise(command: str):
    def register(check: Callable) -> Callable:
        ON_ONE_MACHINE[command] = check
        return check
    return register


def table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    rows = [line.split() for line in out.strip().splitlines()]
    return rows[0], {r[0]: r for r in rows[1:]}


def readme_spec_block() -> Block:
    (block,) = [b for b in experiment_blocks() if b.page == README]
    return block


def readme_spec() -> dict:
    return yaml.safe_load(readme_spec_block().text)


@promise("source .venv/bin/activate")
def _activated(p, sh):
    assert sh.env.get("VIRTUAL_ENV") == str(REPO / ".venv")
    assert sh.which("autolab") == str(REPO / ".venv" / "bin" / "autolab")


@promise("cd ~ && autolab init mylab --profile tiny --data synthetic")
def _initialised(p, sh):
    assert "lab default initialised in" in p.stdout
    assert (sh.home / "mylab" / "lab.yaml").is_file()


@promise("cd mylab")
def _in_the_lab(p, sh):
    assert sh.cwd == sh.home / "mylab"


@promise("autolab master")
def _master(p, sh):
    # "the master's hash: the spec's `parent`": the README's spec names it.
    master = re.search(r"^master:\s+([0-9a-f]{40})$", p.stdout, re.M)
    assert master, p.stdout
    assert master[1] == SEED_HASH
    assert str(readme_spec()["spec"]["parent"]) == master[1][:12], (
        "the README's Experiment names a parent that is not the seed master "
        f"{master[1][:12]} any more: update it (and manifests/examples/)")


@promise("autolab apply -f warmdown-03.yaml")
def _applied(p, sh):
    assert p.stdout.strip() == "experiment.autolab.dev/warmdown-03 created"


@promise("autolab run")
def _ran(p, sh):
    # "reconcile until every experiment is finished": the baseline first, then the experiment.
    assert "measuring its baseline first" in p.stdout
    assert re.search(r"^warmdown-03: Succeeded (Promoted|Rejected) val_bpb=", p.stdout, re.M)


@promise("autolab get -o wide")
def _wide(p, sh):
    head, rows = table(p.stdout)
    promised = sh.comment.replace("...", "").split()
    assert head[:len(promised)] == promised
    assert rows["warmdown-03"][1] == "Succeeded"


@promise("autolab describe warmdown-03")
def _described(p, sh):
    for part in ("Conditions:", "Events:", "Diff:", "+WARMDOWN_RATIO = 0.3"):
        assert part in p.stdout


@promise("autolab logs warmdown-03 -f")
def _logs(p, sh):
    assert "[bench] succeeded: val_bpb" in p.stdout
    assert 'AUTOLAB_RESULT {"version":2,"run":"exp-warmdown-03-1"' in p.stdout


@promise("autolab delete warmdown-03")
def _deleted(p, sh):
    assert p.stdout.startswith("experiment.autolab.dev/warmdown-03 deleted")
    # Recorded, and the name is never reused.
    again = sh.run("autolab apply -f warmdown-03.yaml")
    assert again.returncode != 0 and "warmdown-03" in again.stdout + again.stderr


@promise("autolab ledger")
def _ledger(p, sh):
    head, rows = table(p.stdout)
    assert head[0] == "RUN_ID" and "exp-warmdown-03-1" in rows
    assert any(r.startswith("baseline-") for r in rows)
    tsv = (sh.cwd / "research" / "results.tsv").read_text()
    assert all(run in tsv for run in rows)


@promise("autolab master -o json")
def _master_json(p, sh):
    doc = json.loads(p.stdout)
    assert isinstance(doc["val_bpb"], float) and len(doc["hash"]) == 40
    on_disk = json.loads((sh.cwd / "research" / "live" / "master.json").read_text())
    assert doc["hash"] == on_disk["hash"]


@promise("autolab agents render --for claude")
def _rendered(p, sh):
    assert "CLAUDE.md created" in p.stdout
    assert (sh.cwd / "CLAUDE.md").is_file() and (sh.cwd / ".claude" / "agents").is_dir()


@promise("autolab kickoff --gpu-slots 2 --for claude")
def _kickoff(p, sh):
    assert p.stdout.startswith("# Autolab parent session") and "GPU slots: 2" in p.stdout


@promise("autolab worktree matrix-lr-003")
def _worktree(p, sh):
    path = Path(p.stdout.strip())
    assert path == sh.cwd / ".autolab" / "scratch" / "matrix-lr-003"
    assert (path / "bench" / "train.py").is_file()


@promise("$EDITOR .autolab/scratch/matrix-lr-003/bench/train.py")
def _edited(p, sh):
    assert "MATRIX_LR = 0.03" in (sh.cwd / ".autolab/scratch/matrix-lr-003/bench/train.py") \
        .read_text()


@promise('autolab new matrix-lr-003 --campaign learning-rate -w --hypothesis "A 50% higher '
         'Muon LR for the block matrices learns faster."')
def _drafted(p, sh):
    draft = sh.cwd / "experiments" / "drafts" / "matrix-lr-003.yaml"
    assert p.stdout.strip() == str(draft)
    assert "+MATRIX_LR = 0.03" in yaml.safe_load(draft.read_text())["spec"]["diff"]


@promise("autolab validate experiments/drafts/matrix-lr-003.yaml -o json")
def _validated(p, sh):
    (verdict,) = json.loads(p.stdout)
    assert verdict["ok"] is True and verdict["phase"] == "Queued"


@promise("autolab apply -f experiments/drafts/matrix-lr-003.yaml")
def _applied_draft(p, sh):
    assert p.stdout.strip() == "experiment.autolab.dev/matrix-lr-003 created"


@promise("autolab report")
def _report(p, sh):
    # "leader, campaigns, recent runs, anomalies; research/live/progress.png"
    for heading in ("## Leader", "## Campaigns", "## Recent runs", "## Anomalies"):
        assert heading in p.stdout
    assert (sh.cwd / "research" / "live" / "progress.png").stat().st_size > 0


def test_every_block_of_the_readme_has_a_decision():
    undecided = []
    for c in shell_commands():
        if c.command not in ON_ONE_MACHINE and c.command not in IN_A_CLUSTER \
                and c.command not in NOT_RUN:
            undecided.append(f"{c.block.where} ({c.block.section}): {c.command!r}")
    for b in BLOCKS:
        if b.lang in SHELLS or b.lang == "yaml":
            continue
        if b.key not in NOT_RUN:
            undecided.append(f"{b.where} ({b.section}): a {b.lang or 'bare'} block "
                             f"starting {b.key!r}")
    for b in BLOCKS:
        if b.lang == "yaml" and b not in experiment_blocks() and b not in lab_fragments():
            undecided.append(f"{b.where}: a yaml block that is neither an Experiment nor a Lab "
                             "fragment (a top-level `spec:`)")
    for path in EXAMPLES:
        for c in example_commands(path):
            if c not in IN_A_CLUSTER and not c.startswith("kubectl apply -f manifests/examples/"):
                undecided.append(f"{path.relative_to(REPO)}: {c!r}")
    assert not undecided, ("classify this block (tests/test_readme.py: ON_ONE_MACHINE, "
                           "IN_A_CLUSTER, or NOT_RUN with the reason):\n" + "\n".join(undecided))
    # And nothing decided that no page says any more.
    said = {c.command for c in shell_commands()} | {b.key for b in BLOCKS}
    stale = [k for k in [*ON_ONE_MACHINE, *IN_A_CLUSTER, *NOT_RUN] if k not in said]
    assert not stale, f"no page shows these any more; drop them here: {stale}"
    # A command shown twice would run twice in the walk-through: each page shows its own.
    shown = [c.command for c in shell_commands() if c.command in ON_ONE_MACHINE]
    assert len(shown) == len(set(shown)), sorted(c for c in shown if shown.count(c) > 1)


def autolab_invocations(command: str) -> list[list[str]]:
    """The `autolab ...` commands in a shell line (`cd ~ && autolab init ...` holds one); a
    line that pipes or substitutes is the runtime's, not autolab's (its NOT_RUN reason says)."""
    if any(t in command for t in ("|", "$(", "<(")):
        return []
    out = []
    for part in command.split("&&"):
        argv = shlex.split(part)
        if argv and argv[0] == "autolab":
            out.append(argv[1:])
    return out


def test_every_autolab_command_the_pages_show_parses(capsys):
    """Run or not, a command a page shows names a subcommand and options autolab has: a
    renamed flag fails here, not in a reader's terminal."""
    from controller.cli.main import build_parser
    wrong = []
    for c in shell_commands():
        for argv in autolab_invocations(c.command):
            try:
                build_parser().parse_args(argv)
            except SystemExit:
                wrong.append(f"{c.block.where}: {c.command!r}: {capsys.readouterr().err.strip()}")
    assert not wrong, "\n".join(wrong)


def test_the_demo_the_readme_names_is_the_one_the_suite_runs():
    dev = (REPO / "dev").read_text()
    assert 'demo) exec autolab demo "$@"' in dev
    local = (REPO / "tests" / "test_local.py").read_text()
    assert "from controller.cli.demo import run_demo" in local
    assert "def test_demo_meets_every_outcome" in local
    # `autolab demo` is cmd_demo, which is run_demo with the command line's two options.
    from controller.cli import demo
    from controller.cli.main import build_parser
    assert build_parser().parse_args(["demo"]).fn is demo.cmd_demo
    calls = []
    original, demo.run_demo = demo.run_demo, lambda **kw: calls.append(kw) or 0
    try:
        assert demo.cmd_demo(build_parser().parse_args(["demo"])) == 0
    finally:
        demo.run_demo = original
    assert calls == [{"keep": False, "directory": None}]


# --- one machine --------------------------------------------------------------------------------

class Shell:
    """One reader's terminal: each command runs in bash; the directory and the exported
    environment it leaves behind are where the next one starts."""

    def __init__(self, home: Path, env: dict[str, str]):
        self.home, self.cwd, self.env = home, REPO, env
        self.state = home.parent / "shell-state"
        self.comment = ""  # what the README's comment says of the command just run

    def run(self, text: str, timeout: float = 300) -> subprocess.CompletedProcess:
        env_file, cwd_file = self.state.with_suffix(".env"), self.state.with_suffix(".cwd")
        script = (f"{text}\nrc=$?\npwd > {shlex.quote(str(cwd_file))}\n"
                  f"env -0 > {shlex.quote(str(env_file))}\nexit $rc\n")
        p = subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, text=True,
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout)
        self.cwd = Path(cwd_file.read_text().strip())
        self.env = dict(kv.split("=", 1) for kv in env_file.read_text().split("\0") if "=" in kv)
        return p

    def which(self, name: str) -> str | None:
        for d in self.env.get("PATH", "").split(os.pathsep):
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
        return None


# The reader's own steps between the README's commands: what "the spec above" and "$EDITOR"
# stand for.
def _write_the_spec_above(sh: Shell) -> None:
    (sh.cwd / "warmdown-03.yaml").write_text(readme_spec_block().text + "\n")


BEFORE = {"autolab apply -f warmdown-03.yaml": _write_the_spec_above}


def test_the_one_machine_commands_do_what_the_readme_says(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    editor = tmp_path / "editor"  # the reader's edit: one knob of the master's train.py
    editor.write_text("#!/bin/sh\nsed -i 's/^MATRIX_LR = 0.02 /MATRIX_LR = 0.03 /' \"$1\"\n")
    editor.chmod(0o755)
    path = [d for d in os.environ["PATH"].split(os.pathsep) if not d.startswith(str(REPO))]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "AUTOLAB_"))}
    # Trackio is not what these commands are about (tests/test_tracking.py is).
    env.update(HOME=str(home), PATH=os.pathsep.join(path), EDITOR=str(editor),
               AUTOLAB_TRACKING="0", NO_COLOR="1")
    sh = Shell(home, env)
    ran = []
    for c in shell_commands():
        if c.command not in ON_ONE_MACHINE:
            continue
        if c.command in BEFORE:
            BEFORE[c.command](sh)
        started = time.monotonic()
        p = sh.run(c.text)
        took = time.monotonic() - started
        where = f"{c.block.where}: {c.text}"
        assert p.returncode == 0, f"{where}\nexit {p.returncode}\n{p.stdout}\n{p.stderr}"
        sh.comment = c.comment
        try:
            ON_ONE_MACHINE[c.command](p, sh)
        except AssertionError as e:
            raise AssertionError(f"{where} does not do what the README says: {e}\n"
                                 f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}") from e
        ran.append(f"{took:5.1f}s {c.command}")
    assert len(ran) == len(ON_ONE_MACHINE), ran
    print("\n".join(ran))


# --- specs --------------------------------------------------------------------------------------

def _autolab(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "autolab"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_every_experiment_spec_is_current_and_passes_the_controllers_checks(tmp_path):
    """Every Experiment a page shows, AGENTS.md's and manifests/examples/ too."""
    env = {**os.environ, "HOME": str(tmp_path), "AUTOLAB_TRACKING": "0"}
    init = _autolab("init", "lab", "--profile", "tiny", "--data", "synthetic", cwd=tmp_path,
                    env=env)
    assert init.returncode == 0, init.stderr
    lab = tmp_path / "lab"
    files = []
    for b in experiment_blocks():
        files.append(tmp_path / f"{b.page.stem.lower()}-{b.line}.yaml")
        files[-1].write_text(b.text + "\n")
    # The spec AGENTS.md shows a coding agent, too: the rulebook's example must be current.
    rulebook = (REPO / "AGENTS.md").read_text()
    shown = [b.text for b in readme_blocks(rulebook) if b.lang == "yaml"
             and "kind: Experiment" in b.text]
    assert shown, "AGENTS.md shows no Experiment spec"
    for i, text in enumerate(shown):
        files.append(tmp_path / f"agents-{i}.yaml")
        files[-1].write_text(text + "\n")
    files += EXAMPLES
    for f in files:
        doc = yaml.safe_load(f.read_text())
        assert str(doc["spec"]["parent"]) == SEED_HASH[:12], (
            f"{f.name}: parent {doc['spec']['parent']} is not the seed master {SEED_HASH[:12]} "
            "(bench/train.py changed): write the spec against the current master")
        p = _autolab("validate", str(f), "-o", "json", cwd=lab, env=env)
        assert p.returncode == 0, f"{f.name}: {p.stdout}{p.stderr}"
        (verdict,) = json.loads(p.stdout)
        assert verdict["ok"] and verdict["rebasedFrom"] is None, verdict
    # The examples apply together (the README's own spec is applied by the walkthrough above; it
    # shares warmdown-03's name with an example, so it goes into another lab).
    p = _autolab("apply", "-f", str(REPO / "manifests" / "examples"), cwd=lab, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:-1] == [f"experiment.autolab.dev/{f.stem} created"
                                         for f in EXAMPLES], p.stdout


def test_every_lab_fragment_is_a_valid_lab_spec():
    """A page's Lab fragment, merged into the cluster's default Lab, passes the schema."""
    assert lab_fragments(), "no page shows a Lab fragment (docs/hf-jobs.md's lab.yaml)"
    for block in lab_fragments():
        fragment = yaml.safe_load(block.text)
        lab = yaml.safe_load((REPO / "manifests" / "lab.yaml").read_text())
        lab["spec"] = {k: v for k, v in lab["spec"].items() if k != "kubernetes"}
        lab["spec"].update(fragment["spec"])
        validate_document(lab, source=block.where, kind="Lab")
        LabSpec.from_dict(lab["spec"])
    (block,) = [b for b in lab_fragments() if "backend: hf" in b.text]
    spec = LabSpec.from_dict({**yaml.safe_load((REPO / "manifests" / "lab.yaml").read_text())
                              ["spec"], **yaml.safe_load(block.text)["spec"]})
    assert spec.backend == "hf" and spec.gpu_slots == 2 and spec.hf["flavor"] == "h200"


# --- a cluster ----------------------------------------------------------------------------------

def cluster_commands() -> list[str]:
    """The kubectl lines the pages show (docs/cluster.md's walk-through), in order."""
    return [c.command for c in shell_commands() if c.command in IN_A_CLUSTER]


class Watch:
    """`kubectl get -w` in the background: its lines, as they come."""

    def __init__(self, command: str, env: dict):
        self.proc = subprocess.Popen(["bash", "-c", command], cwd=REPO, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout],
                         daemon=True).start()

    async def until(self, pattern: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.1)
                continue
            self.seen.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"the watch never printed {pattern!r}; it printed {self.seen}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


async def test_the_cluster_commands_do_what_the_readme_says(tmp_path):
    if KUBECTL is None:
        pytest.skip("kubectl is not installed")
    api = Api(tmp_path)  # the emulator, on its own thread
    config = yaml.safe_load(api.config.read_text())
    for ctx in config["contexts"]:
        ctx["context"].pop("namespace", None)  # the reader's kubeconfig: no namespace chosen
    api.config.write_text(yaml.safe_dump(config))
    env = {**os.environ, "KUBECONFIG": str(api.config), "AUTOLAB_TRACKING": "0"}
    c = Cluster(api.em, api.url, k8s.ApiClient(k8s.Configuration(host=api.url)),
                tmp_path / "labs")
    ran: list[str] = []

    async def kubectl(command: str) -> str:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", command, cwd=REPO, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, f"{command}: exit {proc.returncode}\n{out.decode()}" \
                                     f"{err.decode()}"
        ran.append(command)
        return out.decode()

    readme = iter(cluster_commands())

    def next_is(command: str) -> str:
        got = next(readme)
        assert got == command, f"the pages' next cluster command is {got!r}, not {command!r}"
        return got

    try:
        # 2. Install: the CRDs, then the operator's manifests.
        out = await kubectl(next_is("kubectl apply -k crds/"))
        assert "customresourcedefinition.apiextensions.k8s.io/experiments.autolab.dev created" \
            in out
        out = await kubectl(next(readme))
        assert out.count("condition met") == 3, out
        out = await kubectl(next_is("kubectl apply -k manifests/"))
        for made in ("namespace/autolab created", "deployment.apps/autolab-operator created",
                     "lab.autolab.dev/default created", "kopfpeering.kopf.dev/autolab created"):
            assert made in out
        async with operator(c):  # what the Deployment's Pod runs
            # The Deployment controller's part: the Pod is up.
            await c.call(k8s.AppsV1Api(c.api).patch_namespaced_deployment_status,
                         "autolab-operator", NS, {"status": {
                             "observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                             "readyReplicas": 1, "availableReplicas": 1}})
            out = await kubectl(next_is("kubectl -n autolab rollout status "
                                        "deploy/autolab-operator"))
            assert 'deployment "autolab-operator" successfully rolled out' in out
            await c.until("the master ConfigMap", lambda: c.get(CMS, "default-master"))
            await c.until("the Lab's master", lambda: ((c.get("autolab.dev/v1alpha1/labs",
                                                              "default") or {})
                                                       .get("status") or {}).get("master"))
            head, rows = table(await kubectl(next_is("kubectl -n autolab get lab")))
            assert head[:5] == ["NAME", "METRIC", "MASTER", "BEST", "RUNNING"], head
            assert rows["default"][1:3] == ["val_bpb", SEED_HASH[:12]], rows

            # 3. Apply a spec and watch it.
            out = await kubectl(next_is("kubectl explain experiment.spec"))
            assert "KIND:       Experiment" in out and "hypothesis\t<string> -required-" in out
            out = await kubectl(next_is("kubectl apply -f manifests/examples/warmdown-03.yaml"))
            assert out.strip() == "experiment.autolab.dev/warmdown-03 created"
            watch = Watch(next_is("kubectl -n autolab get exp -w"), env)
            ran.append("kubectl -n autolab get exp -w")
            try:
                assert (await watch.until("NAME")).split() == \
                    ["NAME", "PHASE", "OUTCOME", "VAL_BPB", "DELTA", "CAMPAIGN", "AGE"]
                await watch.until(r"^warmdown-03\s")
                # The kubelet's part: the baseline Job's Pod runs and reports, then the run's.
                baseline = await c.until("the baseline Job", lambda: next(
                    (j["metadata"]["name"] for j in c.em.items(JOBS, NS)
                     if j["metadata"]["name"].startswith("baseline-")), None))
                pod = await c.start_pod(baseline)
                await c.finish_pod(pod, result(1.0), 0)
                measured: set[str] = set()
                job = "exp-warmdown-03-1"
                await c.until("the run's Job", lambda: c.get(JOBS, job), timeout=60)
                pod = await c.start_pod(job)
                await _select_its_pods(c, job)
                api.em.logs[(NS, pod)] = "step 00025 loss 4.1\nval_bpb: 0.95\n"
                await watch.until(r"^warmdown-03\s+Running")
                out = await kubectl(next_is("kubectl -n autolab describe exp warmdown-03"))
                assert "Conditions:" in out and "Events:" in out and "RunStarted" in out, out
                out = await kubectl(next_is("kubectl -n autolab logs -f job/exp-warmdown-03-1"))
                assert out == "step 00025 loss 4.1\nval_bpb: 0.95\n"
                await c.finish_pod(pod, result(0.95), 0)
                # One pair is not a verdict: more pairs on the lab's secret seeds, the master
                # run at each place it has no value for yet (in turns, from a secret side).
                await watch.until(r"^warmdown-03\s+Confirming\s")
                for place in (2, 3):
                    for _ in range(2):
                        name = await c.until(f"a pair Job at place {place}", lambda: next(
                            (n for n in (f"{job}-p{place}", f"{job}-m{place}")
                             if c.get(JOBS, n) and n not in measured), None), timeout=60)
                        measured.add(name)
                        pod = await c.start_pod(name)
                        await c.finish_pod(pod, result(0.95 if "-p" in name else 1.0), 0)
                await watch.until(r"^warmdown-03\s+Succeeded\s+Promoted\s+0\.95\s")
            finally:
                watch.stop()
            out = await kubectl(next_is("kubectl -n autolab get cm default-master -o "
                                        "jsonpath='{.data.master\\.json}'"))
            master = json.loads(out)
            assert master["experiment"] == "warmdown-03" and master["val_bpb"] == 0.95

            assert next(readme, None) is None, "a kubectl line of the pages this test does not run"

            # Each example's own first line: apply it, watch it arrive (warmdown-03's is the
            # README's, run above).
            for path in EXAMPLES:
                apply, watching = example_commands(path)
                assert apply == f"kubectl apply -f manifests/examples/{path.name}"
                assert watching == "kubectl -n autolab get exp -w"
                if path.stem == "warmdown-03":
                    assert {apply, watching} <= set(ran)
                    continue
                out = await kubectl(apply)
                assert out.strip() == f"experiment.autolab.dev/{path.stem} created"
                watch = Watch(watching, env)
                try:
                    await watch.until(rf"^{path.stem}\s")
                finally:
                    watch.stop()
                ran.append(watching)
            await c.until("the examples checked", lambda: all(
                c.phase(p.stem) not in (None, "Pending") for p in EXAMPLES))
            assert not any(c.phase(p.stem) in ("Invalid", "Conflict", "Duplicate")
                           for p in EXAMPLES), {p.stem: c.phase(p.stem) for p in EXAMPLES}
    finally:
        c.api.close()
        api.close()
    print("\n".join(ran))


async def _select_its_pods(c: Cluster, job: str) -> None:
    """The API server defaults a Job's selector to its Pods' labels; `kubectl logs job/NAME`
    finds the Pod by it. The emulator leaves that to the caller."""
    await c.call(k8s.BatchV1Api(c.api).patch_namespaced_job, job, NS,
                 {"spec": {"selector": {"matchLabels": {"batch.kubernetes.io/job-name": job}}}})

