"""Agents drive a lab inside the real runtimes: OpenCode and Codex, offline, on a scripted model.

`autolab agents render` writes each runtime's own files; these tests run the runtimes
themselves over them (the versions pinned in tools/agent-runtimes/package.json, installed by
tools/install-agent-runtimes into .devtools/), with the model replaced by
tests/scripted_model.py on 127.0.0.1. The script plays the model's part (which tool to call,
with what arguments); everything else is the runtime's own: its system prompt, how it loads
the rendered agent files and AGENTS.md, its subagent delegation, its shell tool and its
permission system or sandbox. What the runtime sent is recorded and asserted, and the lab
they leave behind is then run by `autolab run` and read from the ledger.

- OpenCode: `opencode run --agent autolab "$(autolab kickoff)"`. The primary delegates to
  `planner`, then to `experiment-worker`, which makes, validates and applies one spec
  through OpenCode's bash and edit tools; a `reviewer` that tries to edit `bench/train.py`
  (with the edit tool, then with `sed -i`) is refused by OpenCode's permissions.
- Codex: `codex exec "$(autolab kickoff --for codex)"`. The parent spawns two
  `experiment-worker` agents at once with the same idea; both apply a clean spec, and the
  controller runs one and records the other as a Duplicate without a run.

A runtime that is not installed is skipped with the reason (set
AUTOLAB_REQUIRE_AGENT_RUNTIMES=1, as .ci/run does, to fail instead); one that is installed
must pass. Each runtime's home, config and data live in a fresh directory, with update
checks, model-list fetches, plugins and telemetry turned off, so nothing leaves the machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from controller.cli import main as cli
from controller.cli.agents import split_front_matter
from controller.local import LocalLab, init_lab

from scripted_model import Call, Reply, Rule, ScriptedModel, Turn

REPO = Path(__file__).resolve().parents[1]
PINS = json.loads((REPO / "tools" / "agent-runtimes" / "package.json").read_text())
BIN = REPO / ".devtools" / "agent-runtimes" / "node_modules" / ".bin"
AUTOLAB = Path(sys.executable).parent / "autolab"
SESSION_TIMEOUT = 300  # a session takes 3-25 s; a loaded CI machine gets room, a hang fails
# One session per runtime: its tests share one pytest worker (`./dev test` runs
# `--dist loadgroup`), so a session is never played twice.
OPENCODE = pytest.mark.xdist_group("opencode-session")
CODEX = pytest.mark.xdist_group("codex-session")

IDEA = {"campaign": "schedule", "old": "WARMDOWN_RATIO = 0.5", "new": "WARMDOWN_RATIO = 0.3",
        "hypothesis": "A shorter warmdown keeps the peak learning rate for longer."}


def runtime(binary: str, package: str) -> Path:
    path = BIN / binary
    if path.exists():
        return path
    reason = (f"{package} {PINS['dependencies'][package]} is not installed in {BIN}: run "
              "tools/install-agent-runtimes (npm; ./dev test and .ci/run do)")
    if os.environ.get("AUTOLAB_REQUIRE_AGENT_RUNTIMES"):
        pytest.fail(reason)
    pytest.skip(reason)


def make_lab(root: Path, gpu_slots: int, *runtimes: str) -> LocalLab:
    """A tiny lab whose wins need one run, with the agents rendered as a user would."""
    lab = init_lab(root, profile="tiny", data="synthetic", budget=2, min_delta=0)
    args = ["agents", "render", "--out", str(root), "--gpu-slots", str(gpu_slots)]
    for r in runtimes:
        args += ["--for", r]
    assert cli.main(args) == 0
    return lab


def kickoff(lab: LocalLab, runtime_name: str, gpu_slots: int) -> str:
    """`autolab kickoff`, as a person would run it in the lab."""
    return subprocess.run([str(AUTOLAB), "kickoff", "--for", runtime_name, "--gpu-slots",
                           str(gpu_slots)], cwd=lab.root, check=True, capture_output=True,
                          text=True).stdout


def offline_home(base: Path) -> dict[str, str]:
    """A bare environment: a fresh home, `autolab` on PATH, and no way to reach a model."""
    base.mkdir(parents=True, exist_ok=True)
    return {"PATH": f"{AUTOLAB.parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(base),
            "XDG_CONFIG_HOME": str(base / ".config"), "XDG_DATA_HOME": str(base / ".local/share"),
            "XDG_CACHE_HOME": str(base / ".cache"), "XDG_STATE_HOME": str(base / ".local/state"),
            "LANG": "C.UTF-8", "TERM": "dumb", "NO_COLOR": "1",
            # Anything but the scripted model goes to a closed port, internet or not.
            **{k: "http://127.0.0.1:9" for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy",
                                                 "https_proxy", "ALL_PROXY", "all_proxy")},
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def body(path: Path) -> str:
    """A rendered agent file without its front matter: what a runtime puts in the context."""
    return split_front_matter(path.read_text(encoding="utf-8"), str(path))[1]


def rulebook(lab: LocalLab) -> str:
    return (lab.root / "AGENTS.md").read_text(encoding="utf-8")


def output_of(result: str) -> str:
    """A shell tool's output without the runtime's preamble (Codex heads it with `Output:`)."""
    return result.split("\nOutput:\n", 1)[-1].strip()


def sent_back(model: ScriptedModel, turn: Turn) -> list[tuple[str, dict]]:
    """The tool calls a runtime sent back in `turn`'s history, checked against the calls the
    script made in that conversation: the runtime carried out exactly what it was told."""
    made = [(c.name, c.arguments) for c in model.replies_to(turn)]
    sent = [(c.name, c.arguments) for c in turn.calls]
    assert sent == made, f"the runtime sent back {sent}, the script made {made}"
    return sent


def ledger(lab: LocalLab) -> dict[str, dict]:
    return {r["experiment_id"]: r for r in LocalLab(lab.root).ledger.rows()}


def run_controller(lab: LocalLab) -> str:
    """`autolab run` in the lab, as the kickoff has the parent session start it: no terminal."""
    p = subprocess.run([str(AUTOLAB), "run", "--interval", "0.3"], cwd=lab.root,
                       capture_output=True, text=True, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout + p.stderr


def surface_untouched(lab: LocalLab) -> bool:
    return subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "bench/train.py"],
                          cwd=lab.root).returncode == 0


# ============================================================================================
# OpenCode: the primary delegates to the planner and a worker; a reviewer cannot edit
# ============================================================================================

def opencode_script(lab: LocalLab) -> list[Rule]:
    name = "warmdown-03"
    draft = f"experiments/drafts/{name}.yaml"

    def primary(t: Turn) -> Reply:
        steps = [("planner", "Propose one fresh single-change experiment against the master."),
                 ("experiment-worker", f"Approved proposal. name: {name}; campaign: "
                                       f"{IDEA['campaign']}; hypothesis: {IDEA['hypothesis']} "
                                       f"change: {IDEA['old']} -> {IDEA['new']}"),
                 ("reviewer", f"Review the spec {draft}.")]
        if t.step < len(steps):
            role, prompt = steps[t.step]
            return Reply(calls=[Call("task", {"description": f"{role} step", "prompt": prompt,
                                              "subagent_type": role})])
        return Reply(text="The lab has one experiment applied: " + name)

    def planner(t: Turn) -> Reply:
        commands = ["autolab master", "autolab ledger"]
        if t.step < len(commands):
            return Reply(calls=[Call("bash", {"command": commands[t.step],
                                              "description": commands[t.step]})])
        return Reply(text=yaml.safe_dump({"proposals": [{
            "name": name, "campaign": IDEA["campaign"], "hypothesis": IDEA["hypothesis"],
            "change": f"{IDEA['old']} -> {IDEA['new']}", "evidence": "none yet",
            "not_a_repeat": "the ledger is empty"}], "skipped": []}))

    def worker(t: Turn) -> Reply:
        scratch = output_of(t.results[0]) if t.results else ""
        surface = f"{scratch}/bench/train.py"
        plan = [("bash", {"command": f"autolab worktree {name}"}),
                ("read", {"filePath": surface}),
                ("edit", {"filePath": surface, "oldString": IDEA["old"],
                          "newString": IDEA["new"]}),
                ("bash", {"command": f"autolab new {name} --campaign {IDEA['campaign']} -w "
                                     f"--hypothesis \"{IDEA['hypothesis']}\""}),
                ("bash", {"command": f"autolab validate {draft} -o json"}),
                ("bash", {"command": f"autolab apply -f {draft}"}),
                # The master's own surface is not the worker's to edit: refused.
                ("edit", {"filePath": str(lab.root / "bench" / "train.py"),
                          "oldString": IDEA["old"], "newString": IDEA["new"]})]
        if t.step < len(plan):
            tool, args = plan[t.step]
            if tool == "bash":
                args = {**args, "description": args["command"][:40]}
            return Reply(calls=[Call(tool, args)])
        return Reply(text=yaml.safe_dump({"experiment": name, "spec_file": draft,
                                          "phase": "Pending"}))

    def reviewer(t: Turn) -> Reply:
        plan = [Call("edit", {"filePath": str(lab.root / "bench" / "train.py"),
                              "oldString": IDEA["old"], "newString": "WARMDOWN_RATIO = 0.1"}),
                Call("bash", {"command": "sed -i 's/WARMDOWN_RATIO = 0.5/WARMDOWN_RATIO = 0.1/' "
                                         "bench/train.py", "description": "edit the surface"}),
                Call("bash", {"command": f"autolab validate {draft} -o json",
                              "description": "validate"})]
        if t.step < len(plan):
            return Reply(calls=[plan[t.step]])
        return Reply(text=yaml.safe_dump({"verdicts": [{"name": name, "verdict": "approve"}]}))

    return [Rule("planner", r"# Autolab planner\n", planner),
            Rule("experiment-worker", r"# Autolab experiment-worker\n", worker),
            Rule("reviewer", r"# Autolab reviewer\n", reviewer),
            Rule("autolab", r"# Autolab parent session\n", primary)]


def play(command: list[str], model: ScriptedModel, **kw) -> tuple[subprocess.CompletedProcess,
                                                                    float]:
    """Run a session to its end; on failure or a hang, say what the model saw."""
    started = time.monotonic()
    try:
        p = subprocess.run(command, capture_output=True, text=True, timeout=SESSION_TIMEOUT, **kw)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{command[1]} {command[2]} ran past {SESSION_TIMEOUT} s:\n"
                    f"{(e.stderr or b'')[-3000:]!r}\n{model.transcript()}")
    assert p.returncode == 0 and not model.errors, \
        f"{command[1]} {command[2]} failed ({p.returncode}):\n{p.stderr[-4000:]}\n" \
        f"{model.transcript()}"
    return p, time.monotonic() - started


def opencode_env(home: Path, model: ScriptedModel) -> dict[str, str]:
    """OpenCode on the scripted model, with every call home turned off."""
    config = {"$schema": "https://opencode.ai/config.json",
              "provider": {"scripted": {
                  "npm": "@ai-sdk/openai-compatible", "name": "Scripted model",
                  "options": {"baseURL": model.url, "apiKey": "not-a-key"},
                  "models": {"script": {"name": "script", "tool_call": True}}}},
              "model": "scripted/script", "small_model": "scripted/script",
              "autoupdate": False, "share": "disabled"}
    return {**offline_home(home), "OPENCODE_CONFIG_CONTENT": json.dumps(config),
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
            "OPENCODE_DISABLE_SHARE": "1", "OPENCODE_DISABLE_CLAUDE_CODE": "1",
            "OPENCODE_DISABLE_EXTERNAL_SKILLS": "1"}


# Session, not module: a worker that runs another module's test in between would tear a module
# fixture down and make it again; this one is made once per worker that uses it.
@pytest.fixture(scope="session")
def opencode_session(tmp_path_factory):
    opencode = runtime("opencode", "opencode-ai")
    root = tmp_path_factory.mktemp("opencode")
    lab = make_lab(root / "lab", 1, "opencode")
    prompt = kickoff(lab, "opencode", 1)
    with ScriptedModel(opencode_script(lab)) as model:
        # `autolab kickoff | opencode run --agent autolab`: as an argument, OpenCode would
        # hand the prompt over in quotes (it quotes every argument with a space in it).
        p, seconds = play([str(opencode), "run", "--agent", "autolab", "--format", "json"],
                          model, input=prompt, cwd=lab.root,
                          env=opencode_env(root / "home", model))
    return lab, model, prompt, p.stdout, seconds


@OPENCODE
def test_opencode_session_receives_the_kickoff_prompt_the_agent_file_and_the_rulebook(
        opencode_session):
    lab, model, prompt, _, _ = opencode_session
    assert {e.path for e in model.exchanges} == {"/v1/chat/completions"}  # nothing else asked
    first = model.turns("autolab")[0]
    assert first.user.strip() == prompt.strip()
    assert body(lab.root / ".opencode/agents/autolab.md").strip() in first.system
    assert rulebook(lab).strip() in first.system
    for role in ("planner", "experiment-worker", "reviewer"):
        turn = model.turns(role)[0]
        assert body(lab.root / f".opencode/agents/{role}.md").strip() in turn.system, role
        assert rulebook(lab).strip() in turn.system, role
    # The primary may delegate to the lab's roles and to no other subagent, and edits nothing.
    task = next(t for t in first.body["tools"] if t["function"]["name"] == "task")
    assert "- experiment-worker:" in task["function"]["description"]
    assert "- general:" not in task["function"]["description"]
    assert "edit" not in first.tools and "write" not in first.tools


@OPENCODE
def test_opencode_primary_delegates_to_the_planner_then_to_a_worker(opencode_session):
    _, model, _, _, _ = opencode_session
    order = [c.arguments["subagent_type"] for c in model.calls("autolab")]
    assert order == ["planner", "experiment-worker", "reviewer"]
    sent = sent_back(model, model.turns("autolab")[-1])
    assert [name for name, _ in sent] == ["task"] * 3
    planner = model.turns("planner")
    assert "afe388e5b85f" in planner[1].last_result  # `autolab master` ran in its bash tool
    # The planner's answer came back to the primary as the task's result.
    assert "warmdown-03" in model.turns("autolab")[2].last_result


@OPENCODE
def test_opencode_worker_runs_the_four_authoring_commands_and_the_spec_runs(opencode_session):
    lab, model, _, _, _ = opencode_session
    turns = model.turns("experiment-worker")
    results = turns[-1].results
    commands = [args.get("command") for tool, args in sent_back(model, turns[-1])
                if tool == "bash"]
    assert [c.split()[1] for c in commands] == ["worktree", "new", "validate", "apply"]
    scratch = output_of(results[0])
    assert scratch.endswith(".autolab/scratch/warmdown-03"), model.transcript()
    assert "experiments/drafts/warmdown-03.yaml" in results[3]        # autolab new -w
    finding = json.loads(output_of(results[4]))[0]                    # autolab validate -o json
    assert finding["ok"] and finding["phase"] == "Queued", finding
    assert "warmdown-03 created" in results[5]                        # autolab apply -f
    assert "rule which prevents you from using this specific tool call" in results[6]
    spec = yaml.safe_load((lab.root / "experiments/warmdown-03.yaml").read_text())
    assert f"+{IDEA['new']}" in spec["spec"]["diff"]
    said = run_controller(lab)
    row = ledger(lab)["warmdown-03"]
    assert row["status"] == "succeeded" and float(row["val_bpb"]) > 0, row
    # What the controller prints fits an agent's context (a shell tool shows it whole).
    assert "warmdown-03" in said and len(said) < 4000, said


@OPENCODE
def test_opencode_refuses_a_reviewer_that_edits_the_surface(opencode_session):
    lab, model, _, _, _ = opencode_session
    turns = model.turns("reviewer")
    assert "edit" not in turns[0].tools and "bash" in turns[0].tools
    # OpenCode records the call of a tool it does not offer as its own `invalid` tool.
    sent, made = turns[-1].calls, model.replies_to(turns[-1])
    assert (sent[0].name, sent[0].arguments["tool"], made[0].name) == ("invalid", "edit", "edit")
    assert [(c.name, c.arguments) for c in sent[1:]] == [(c.name, c.arguments) for c in made[1:]]
    edit, sed, validate = turns[-1].results
    assert "unavailable tool 'edit'" in edit, edit
    assert "rule which prevents you from using this specific tool call" in sed, sed
    finding = json.loads(output_of(validate))[0]
    assert finding["name"] == "warmdown-03"
    assert "already applied: phase Pending" in finding["notes"], finding  # not "phase None"
    assert surface_untouched(lab)
    text = (lab.root / "bench" / "train.py").read_text()
    assert "WARMDOWN_RATIO = 0.1" not in text


# ============================================================================================
# Codex: two experiment-workers at once with the same idea; the GPU is spent once
# ============================================================================================

def codex_script(lab: LocalLab, names: tuple[str, str]) -> list[Rule]:
    both_validated = threading.Barrier(2, timeout=60)

    def parent(t: Turn) -> Reply:
        if t.step == 0:  # both workers in one answer: they run at once
            return Reply(calls=[Call("spawn_agent", {
                "agent_type": "experiment-worker",
                "message": f"Approved proposal. name: {n}; campaign: {IDEA['campaign']}; "
                           f"hypothesis: {IDEA['hypothesis']} change: {IDEA['old']} -> "
                           f"{IDEA['new']}"}, namespace="multi_agent_v1") for n in names])
        ids = [json.loads(r)["agent_id"] for r in t.results[:2]]
        if t.step <= 2:
            return Reply(calls=[Call("wait_agent", {"targets": [ids[t.step - 1]],
                                                    "timeout_ms": 120000},
                                     namespace="multi_agent_v1")])
        return Reply(text="Both workers returned.")

    def worker(t: Turn) -> Reply:
        name = re.search(r"name: ([a-z0-9-]+);", t.user).group(1)
        draft = f"experiments/drafts/{name}.yaml"
        scratch = output_of(t.results[0]) if t.results else ""
        plan = [f"autolab worktree {name}",
                f"sed -i 's/^{IDEA['old']}/{IDEA['new']}/' {scratch}/bench/train.py",
                f"autolab new {name} --campaign {IDEA['campaign']} -w "
                f"--hypothesis \"{IDEA['hypothesis']}\"",
                f"autolab validate {draft} -o json",
                f"autolab apply -f {draft}"]
        if t.step == 4:  # apply only once both have validated: the two specs race for real
            both_validated.wait()
        if t.step < len(plan):
            return Reply(calls=[Call("exec_command", {"cmd": plan[t.step]})])
        return Reply(text=yaml.safe_dump({"experiment": name, "spec_file": draft}))

    return [Rule("experiment-worker", r"# Autolab experiment-worker\n", worker),
            Rule("parent", r"(?m)^# Autolab parent session\n", parent, in_user=True)]


def codex_home(model: ScriptedModel, lab: LocalLab) -> Path:
    """CODEX_HOME with the scripted provider, the lab trusted, and nothing that calls home.

    Not under /tmp: Codex's sandbox gives commands a /tmp of their own, where its helper
    (linked from CODEX_HOME) would not be found.
    """
    base = REPO / ".devtools" / "homes"
    if str(base).startswith("/tmp/"):
        base = Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="codex-", dir=base))
    (home / "config.toml").write_text(
        'model = "script"\nmodel_provider = "scripted"\n'
        'check_for_update_on_startup = false\n\n'
        '[analytics]\nenabled = false\n\n[feedback]\nenabled = false\n\n'
        '[features]\nplugins = false\napps = false\n\n'
        '[model_providers.scripted]\nname = "Scripted model"\n'
        f'base_url = "{model.url}"\nenv_key = "SCRIPTED_API_KEY"\nwire_api = "responses"\n'
        'request_max_retries = 0\nstream_max_retries = 0\n\n'
        f'[projects."{lab.root}"]\ntrust_level = "trusted"\n')
    return home


# Session, not module: a worker that runs another module's test in between would tear a module
# fixture down and make it again; this one is made once per worker that uses it.
@pytest.fixture(scope="session")
def codex_session(tmp_path_factory):
    codex = runtime("codex", "@openai/codex")
    root = tmp_path_factory.mktemp("codex")
    lab = make_lab(root / "lab", 2, "codex")
    prompt = kickoff(lab, "codex", 2)
    names = ("warmdown-a", "warmdown-b")
    with ScriptedModel(codex_script(lab, names)) as model:
        home = codex_home(model, lab)
        try:
            env = {**offline_home(home), "CODEX_HOME": str(home),
                   "SCRIPTED_API_KEY": "not-a-key", "RUST_LOG": "error"}
            _, seconds = play([str(codex), "exec", "--json", prompt], model, cwd=lab.root,
                              env=env, stdin=subprocess.DEVNULL)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    return lab, model, prompt, names, seconds


@CODEX
def test_codex_session_receives_the_kickoff_prompt_the_agent_file_and_the_rulebook(
        codex_session):
    lab, model, prompt, _, _ = codex_session
    assert {e.path for e in model.exchanges} == {"/v1/responses"}  # nothing else asked
    first = model.turns("parent")[0]
    assert prompt.strip() in [m.strip() for m in first.user_messages]
    assert rulebook(lab).strip() in first.user  # Codex hands AGENTS.md over as a user message
    sent = sent_back(model, model.turns("parent")[-1])
    assert [name for name, _ in sent] == ["spawn_agent", "spawn_agent", "wait_agent", "wait_agent"]
    spawn = next(t for t in first.body["tools"] if t.get("name") == "multi_agent_v1")
    spawn_text = json.dumps(spawn)
    assert "experiment-worker" in spawn_text  # the rendered .codex/agents/ were loaded
    instructions = tomllib.loads((lab.root / ".codex/agents/experiment-worker.toml")
                                 .read_text())["developer_instructions"]
    for turn in model.turns("experiment-worker"):
        assert instructions.strip() in turn.system
        assert rulebook(lab).strip() in turn.user


@CODEX
def test_codex_workers_run_the_authoring_commands_in_the_sandbox(codex_session):
    lab, model, _, names, _ = codex_session
    finals = {re.search(r"name: ([a-z0-9-]+);", t.user).group(1): t
              for t in model.turns("experiment-worker") if len(t.results) == 5}
    assert set(finals) == set(names), model.transcript()
    for name, t in finals.items():
        commands = [args["cmd"] for _, args in sent_back(model, t)]
        assert [c.split()[1] for c in commands if c.startswith("autolab")] == \
            ["worktree", "new", "validate", "apply"]
        assert output_of(t.results[0]).endswith(f".autolab/scratch/{name}"), t.results[0]
        assert "exited with code 0" in t.results[1]
        assert f"experiments/drafts/{name}.yaml" in t.results[2]
        finding = json.loads(output_of(t.results[3]))[0]
        assert finding["ok"], finding
        assert "exited with code 0" in t.results[4], t.results[4]
        assert (lab.root / "experiments" / f"{name}.yaml").exists()


@CODEX
def test_two_workers_with_the_same_idea_spend_the_gpu_once(codex_session):
    lab, _, _, names, _ = codex_session
    run_controller(lab)
    rows = ledger(lab)
    ran = [n for n in names if rows[n]["status"] == "succeeded"]
    dup = [n for n in names if rows[n]["status"] == "duplicate"]
    assert len(ran) == 1 and len(dup) == 1, {n: rows[n]["status"] for n in names}
    assert rows[dup[0]]["duplicate_of"] == ran[0]
    assert not rows[dup[0]]["val_bpb"] and not rows[dup[0]]["job_id"]
    runs = {p.name for p in (lab.root / ".autolab" / "runs").iterdir()}
    assert any(ran[0] in r for r in runs) and not any(dup[0] in r for r in runs), runs
