"""One contract per role, rendered into every agent runtime: the files parse and say the same."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from controller.local import init_lab
from controller.cli import agents, main as cli
from controller.cli.agents import (RUNTIMES, kickoff_text, load_contracts, render,
                                  split_front_matter)
from controller.core.spec import SpecError

ROLES = {"planner", "reviewer", "experiment-worker", "memory-keeper", "researcher", "reporter"}


@pytest.fixture(scope="module")
def contracts():
    return load_contracts()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("project")
    assert cli.main(["agents", "render", "--for", "all", "--out", str(out),
                     "--gpu-slots", "4"]) == 0
    return out


def front(path: Path) -> tuple[dict, str]:
    return split_front_matter(path.read_text(encoding="utf-8"), str(path))


def test_every_role_has_one_contract_with_purpose_inputs_scope_and_outputs(contracts):
    assert {c.name for c in contracts} == ROLES
    for c in contracts:
        assert c.description and c.reads and c.returns, c.name
        assert set(c.capabilities) <= set(agents.CAPABILITIES)
        prompt = c.prompt()
        for field_name in c.returns:
            assert f"`{field_name}`" in prompt
    worker = next(c for c in contracts if c.name == "experiment-worker")
    assert worker.can("edit") and worker.can("shell")
    assert any("bench/train.py" in m for m in worker.may_change)
    assert not next(c for c in contracts if c.name == "planner").may_change


def test_opencode_agents_are_markdown_with_front_matter(rendered, contracts):
    for c in contracts:
        meta, body = front(rendered / ".opencode" / "agents" / f"{c.name}.md")
        assert meta["mode"] == "subagent" and meta["description"] == c.description
        assert meta["permission"]["webfetch"] == ("allow" if c.can("web") else "deny")
        assert c.prompt() in body
    meta, body = front(rendered / ".opencode" / "agents" / "autolab.md")
    assert meta["mode"] == "primary"
    assert "Never more than 4 experiment-workers at once" in body


def opencode_allows(rules: str | dict, subject: str) -> bool:
    """OpenCode's reading of a permission: the last pattern that matches wins ('*' any text)."""
    if isinstance(rules, str):
        return rules == "allow"
    verdict = "ask"
    for pattern, action in rules.items():
        if re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), subject, re.S):
            verdict = action
    return verdict == "allow"


@pytest.mark.parametrize("role,subject,allowed", [
    ("experiment-worker", ".autolab/scratch/warmdown-03/bench/train.py", True),
    ("experiment-worker", "experiments/drafts/warmdown-03.yaml", True),
    ("experiment-worker", "bench/train.py", False),       # the master's surface
    ("experiment-worker", "research/results.tsv", False),  # the ledger
    ("memory-keeper", "research/campaigns/schedule.md", True),
    ("memory-keeper", "research/live/master.json", False),
    ("reviewer", "bench/train.py", False),
    ("planner", "research/notes.md", False),
])
def test_opencode_roles_edit_only_what_their_contract_names(rendered, role, subject, allowed):
    meta, _ = front(rendered / ".opencode" / "agents" / f"{role}.md")
    assert opencode_allows(meta["permission"]["edit"], subject) is allowed


@pytest.mark.parametrize("role,command,allowed", [
    ("experiment-worker", "autolab worktree warmdown-03", True),
    ("experiment-worker", "autolab validate experiments/drafts/warmdown-03.yaml -o json", True),
    ("experiment-worker", "autolab apply -f experiments/drafts/warmdown-03.yaml", True),
    ("experiment-worker", "autolab run", False),           # the controller is not the worker's
    ("reviewer", "autolab validate experiments/drafts/x.yaml -o json", True),
    ("reviewer", "autolab ledger", True),
    ("reviewer", "sed -i s/0.5/0.1/ bench/train.py", False),
    ("reviewer", "autolab apply -f experiments/drafts/x.yaml", False),
    ("planner", "git show autolab/master:bench/train.py", True),
    ("planner", "rm -rf research", False),
    ("autolab", "autolab report", True),
    ("autolab", "python bench/train.py", False),
])
def test_opencode_roles_run_only_the_commands_their_contract_lists(rendered, role, command,
                                                                  allowed):
    meta, _ = front(rendered / ".opencode" / "agents" / f"{role}.md")
    assert opencode_allows(meta["permission"]["bash"], command) is allowed


def test_opencode_primary_delegates_only_to_the_roles_and_edits_nothing(rendered, contracts):
    meta, _ = front(rendered / ".opencode" / "agents" / "autolab.md")
    task = meta["permission"]["task"]
    assert all(opencode_allows(task, c.name) for c in contracts)
    assert not opencode_allows(task, "general") and not opencode_allows(task, "explore")
    assert meta["permission"]["edit"] == "deny"


def test_claude_subagents_name_their_tools_and_import_the_rulebook(rendered, contracts):
    for c in contracts:
        meta, body = front(rendered / ".claude" / "agents" / f"{c.name}.md")
        assert meta["name"] == c.name and meta["description"] == c.description
        tools = [t.strip() for t in meta["tools"].split(",")]
        assert "Read" in tools
        assert ("Edit" in tools) == c.can("edit") and ("Bash" in tools) == c.can("shell")
        assert ("WebFetch" in tools) == c.can("web")
        assert c.prompt() in body
    assert "@AGENTS.md" in (rendered / "CLAUDE.md").read_text()


def test_codex_agents_are_toml_with_the_required_keys(rendered, contracts):
    for c in contracts:
        doc = tomllib.loads((rendered / ".codex" / "agents" / f"{c.name}.toml").read_text())
        assert doc["name"] == c.name and doc["description"] == c.description
        assert doc["developer_instructions"] == c.prompt()
        assert doc["sandbox_mode"] == ("workspace-write" if c.can("edit") else "read-only")
    config = tomllib.loads((rendered / ".codex" / "config.toml").read_text())
    assert config["agents"]["max_threads"] == 4
    # workspace-write keeps .git read-only, where `autolab worktree` and `validate` write
    # (relative to .codex/); commands keep the PATH that finds `autolab`.
    assert config["sandbox_workspace_write"]["writable_roots"] == ["../.git"]
    assert config["allow_login_shell"] is False


def test_pi_agents_settings_and_prompt_template(rendered, contracts):
    for c in contracts:
        meta, body = front(rendered / ".pi" / "agents" / f"{c.name}.md")
        assert meta["name"] == c.name and meta["description"] == c.description
        tools = [t.strip() for t in meta["tools"].split(",")]
        assert "read" in tools and ("bash" in tools) == c.can("shell")
        assert c.prompt() in body
    settings = json.loads((rendered / ".pi" / "settings.json").read_text())
    assert "npm:pi-subagents" in settings["packages"]
    meta, body = front(rendered / ".pi" / "prompts" / "autolab.md")
    assert meta["description"] and "$@" in body


def test_hermes_skills_carry_each_contract_and_the_delegation_ceiling(rendered, contracts):
    for c in contracts:
        meta, body = front(rendered / ".agents" / "skills" / f"autolab-{c.name}" / "SKILL.md")
        assert meta["name"] == f"autolab-{c.name}" and meta["description"] == c.description
        assert len(meta["description"]) <= 1024 and meta["metadata"]["hermes"]["tags"]
        assert c.prompt() in body
    meta, body = front(rendered / ".agents" / "skills" / "autolab-delegation" / "SKILL.md")
    assert meta["name"] == "autolab-delegation"
    assert "delegate_task" in body
    assert "Never more than 3 experiment-workers at once" in body  # 4 slots, Hermes caps at 3
    assert '"web"' in body and '"terminal"' in body  # each role's toolsets are spelled out


def test_every_runtime_carries_the_same_words_for_a_role(rendered):
    """The point of one source: no runtime's copy of a role can drift from another's."""
    worker = next(c for c in load_contracts() if c.name == "experiment-worker").prompt()
    copies = [front(rendered / ".opencode/agents/experiment-worker.md")[1],
              front(rendered / ".claude/agents/experiment-worker.md")[1],
              front(rendered / ".pi/agents/experiment-worker.md")[1],
              front(rendered / ".agents/skills/autolab-experiment-worker/SKILL.md")[1],
              tomllib.loads((rendered / ".codex/agents/experiment-worker.toml").read_text())
              ["developer_instructions"]]
    assert all(worker in c for c in copies)


def test_a_lab_gets_the_rulebook_and_render_is_repeatable(rendered):
    assert (rendered / "AGENTS.md").read_text() == agents.RULEBOOK.read_text()
    again = render(list(RUNTIMES), rendered, gpu_slots=4)
    assert {verb for _, verb in again} == {"unchanged"}


def test_render_never_overwrites_a_hand_written_file(tmp_path):
    mine = tmp_path / "CLAUDE.md"
    mine.write_text("# my own instructions\n")
    settings = tmp_path / ".pi" / "settings.json"
    settings.parent.mkdir()
    settings.write_text(json.dumps({"packages": ["npm:pi-web-access"], "theme": "dark"}))
    done = dict(render(["claude", "pi"], tmp_path))
    assert mine.read_text() == "# my own instructions\n"
    assert done["CLAUDE.md"].startswith("skipped")
    merged = json.loads(settings.read_text())
    assert merged["theme"] == "dark"
    assert merged["packages"] == ["npm:pi-web-access", "npm:pi-subagents"]


def test_a_broken_contract_is_refused_with_file_and_field(tmp_path):
    (tmp_path / "planner.md").write_text("---\nname: planner\ndescription: x\n"
                                         "capabilities: [read, teleport]\nreads: [a]\n"
                                         "may_change: []\nreturns: {a: b}\n---\nDo it.\n")
    with pytest.raises(SpecError, match=r"planner.md: capabilities: unknown \['teleport'\]"):
        load_contracts(tmp_path)
    (tmp_path / "planner.md").write_text("no front matter")
    with pytest.raises(SpecError, match="front matter"):
        load_contracts(tmp_path)


@pytest.mark.parametrize("runtime,slots,cap", [("opencode", 2, 2), ("claude", 1, 1),
                                               ("codex", 8, 8), ("hermes", 8, 3),
                                               ("pi", 3, 3)])
def test_kickoff_never_runs_more_workers_than_gpu_slots(runtime, slots, cap, capsys):
    assert cli.main(["kickoff", "--gpu-slots", str(slots), "--for", runtime,
                     "--lab", "/nonexistent"]) == 0
    text = capsys.readouterr().out
    assert f"Never more than {cap} experiment-worker" in text
    assert "AGENTS.md" in text
    for role in ROLES:
        assert role in text


def test_kickoff_reports_the_lab_it_runs(tmp_path):
    lab = init_lab(tmp_path / "lab", profile="tiny", data="synthetic")
    text = kickoff_text("claude", 1, lab=lab)
    assert f"master {lab.repo.master().hash[:12]}" in text
    assert "not measured yet" in text


def test_rendered_yaml_front_matter_round_trips_through_yaml(rendered):
    for path in rendered.rglob("*.md"):
        if path.name in ("AGENTS.md", "CLAUDE.md"):
            continue
        meta, _ = front(path)
        assert yaml.safe_load(yaml.safe_dump(meta)) == meta
