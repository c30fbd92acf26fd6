"""The pre-run checks a user meets: one test per refusal kind, asserting the message they see."""

from __future__ import annotations

import difflib
import hashlib
import subprocess
from pathlib import Path

import pytest

from controller.core.spec import LabSpec
from controller.lab.repo import LabRepo

SURFACE = '''"""A stand-in surface: the checks do not care what the program does."""
LEARNING_RATE = 0.02  # peak learning rate
WARMDOWN = 0.5  # fraction of the budget spent decaying


def train():
    return LEARNING_RATE * WARMDOWN


if __name__ == "__main__":
    print(train())
'''


def udiff(old: str, new: str, path: str = "train.py") -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True),
                                        f"a/{path}", f"b/{path}"))


@pytest.fixture()
def repo(tmp_path: Path) -> LabRepo:
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "train.py").write_text(SURFACE)
    (tmp_path / "bench" / "prepare.py").write_text("SEQ = 8\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q", "-b", "main"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", "-A"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "seed"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    r = LabRepo(tmp_path, LabSpec())
    r.seed_master(head)
    return r


def spec(repo: LabRepo, diff: str, parent: str | None = None):
    from controller.core.spec import ExperimentSpec
    return ExperimentSpec(hypothesis="Try it.", parent=parent or repo.master().hash[:8], diff=diff)


def refusal(repo, diff, parent=None):
    c = repo.materialise("e1", spec(repo, diff, parent))
    assert c.refusal, "expected the candidate to be refused"
    assert not repo.has_worktree("e1"), "a refused candidate leaves no worktree"
    return c


def test_diff_naming_the_surface_by_file_name_or_lab_path_applies(repo):
    new = SURFACE.replace("0.02", "0.03")
    for path in ("train.py", "bench/train.py"):
        c = repo.materialise("e1", spec(repo, udiff(SURFACE, new, path)))
        assert c.refusal is None, c.message
        assert repo.candidate_source("e1") == new
        repo.cleanup("e1", keep_branch=False)


def test_diff_touching_prepare_is_refused(repo):
    c = refusal(repo, udiff("SEQ = 8\n", "SEQ = 9\n", "prepare.py"))
    assert (c.refusal, c.reason) == ("Invalid", "DiffTouchesOtherFile")
    assert str(c.message) == "diff touches prepare.py; only bench/train.py may change"


def test_two_files_in_one_diff_are_refused(repo):
    d = udiff(SURFACE, SURFACE.replace("0.02", "0.03")) + udiff("SEQ = 8\n", "SEQ = 9\n",
                                                                 "bench/prepare.py")
    assert refusal(repo, d).reason == "DiffTouchesOtherFile"


def test_rename_new_deleted_binary_and_mode_changes_are_refused(repo):
    cases = {
        "DiffRenames": "diff --git a/train.py b/t2.py\nsimilarity index 90%\nrename from train.py\n"
                       "rename to t2.py\n",
        "DiffCreatesOrDeletes": "--- /dev/null\n+++ b/train.py\n@@ -0,0 +1 @@\n+x = 1\n",
        "DiffBinary": "diff --git a/train.py b/train.py\nGIT binary patch\nliteral 3\nabc\n",
        "DiffModeChange": "diff --git a/train.py b/train.py\nold mode 100644\nnew mode 100755\n",
    }
    for reason, d in cases.items():
        c = refusal(repo, d)
        assert c.reason == reason, (reason, c.message)
    assert "new file mode" in refusal(repo, "diff --git a/train.py b/train.py\nnew file mode "
                                            "100644\n").message


def test_parent_directory_and_absolute_paths_are_refused(repo):
    for path in ("../bench/train.py", "/etc/passwd"):
        d = f"--- {path}\n+++ {path}\n@@ -1 +1 @@\n-a\n+b\n"
        c = refusal(repo, d)
        assert c.reason == "DiffUnsafePath"
        assert "never absolute paths or '..'" in c.message


def test_hunk_that_does_not_apply_names_the_place(repo):
    d = udiff(SURFACE.replace("0.02", "0.05"), SURFACE.replace("0.02", "0.03"))
    c = refusal(repo, d)
    assert c.reason == "DiffDoesNotApply"
    assert "does not apply to its parent" in c.message and "bench/train.py" in c.message


def test_text_that_is_not_a_diff_is_refused(repo):
    for text, expect in (("just some words\n", "no '--- a/train.py'"),
                         ("--- a/train.py\n+++ b/train.py\n@@ -1,3 +1,3 @@\n-a\n", "truncated"),
                         ("   \n", "diff is empty")):
        assert expect in refusal(repo, text).message


def test_candidate_that_does_not_compile_is_invalid(repo):
    c = refusal(repo, udiff(SURFACE, SURFACE.replace("return LEARNING_RATE", "return (")))
    assert c.reason == "CompileError"
    assert c.message.startswith("candidate does not compile: bench/train.py line 7")


def test_unknown_or_ambiguous_parent_is_refused(repo):
    c = refusal(repo, udiff(SURFACE, SURFACE.replace("0.02", "0.03")), parent="deadbeef")
    assert c.reason == "UnknownParent"
    assert f"current master {repo.master().hash[:12]}" in c.message


def test_stale_parent_rebases_cleanly_and_records_where_it_came_from(repo):
    repo.set_master_metric(1.0)
    seed = repo.master()
    moved = SURFACE.replace("0.02", "0.03")
    c = repo.materialise("winner", spec(repo, udiff(SURFACE, moved)))
    repo.promote("winner", c.commit, 0.9, (c.candidate_hash, c.semantic_hash), seed.hash, "now")
    assert repo.master().experiment == "winner"
    # Written against the seed, touching other lines: rebases onto the new master.
    d = udiff(SURFACE, SURFACE.replace("print(train())", "print(train(), flush=True)"))
    c2 = repo.materialise("late", spec(repo, d, parent=seed.hash[:8]))
    assert c2.refusal is None, c2.message
    assert c2.rebased_from == seed.hash and c2.parent_hash == repo.master().hash
    src = repo.candidate_source("late")
    assert "LEARNING_RATE = 0.03" in src and "flush=True" in src
    log = subprocess.run(["git", "log", "-1", "--format=%B", "autolab/exp/late"], cwd=repo.root,
                         capture_output=True, text=True).stdout
    assert "Autolab-Rebased-From: " + seed.hash in log and "Autolab-Experiment: late" in log


def test_stale_parent_that_conflicts_shows_the_hunk(repo):
    repo.set_master_metric(1.0)
    seed = repo.master()
    c = repo.materialise("winner", spec(repo, udiff(SURFACE, SURFACE.replace("0.02", "0.03"))))
    repo.promote("winner", c.commit, 0.9, (c.candidate_hash, c.semantic_hash), seed.hash, "now")
    d = udiff(SURFACE, SURFACE.replace("0.02", "0.01"))
    c2 = refusal(repo, d, parent=seed.hash[:8])
    assert (c2.refusal, c2.reason) == ("Conflict", "RebaseConflict")
    assert "conflicts with the current master" in c2.message
    assert "LEARNING_RATE = 0.03" in c2.message and "LEARNING_RATE = 0.01" in c2.message


def test_comment_only_change_hashes_the_same_semantically(repo):
    a = repo.materialise("a", spec(repo, udiff(SURFACE, SURFACE.replace("0.02", "0.03"))))
    commented = SURFACE.replace("0.02  # peak learning rate", "0.03  # a higher peak, same idea")
    b = repo.materialise("b", spec(repo, udiff(SURFACE, commented + "\n\n")))
    assert a.candidate_hash != b.candidate_hash
    assert a.semantic_hash == b.semantic_hash


def test_promotion_is_compare_and_swap(repo):
    seed = repo.master()
    repo.set_master_metric(1.0)
    c = repo.materialise("a", spec(repo, udiff(SURFACE, SURFACE.replace("0.02", "0.03"))))
    d = repo.materialise("b", spec(repo, udiff(SURFACE, SURFACE.replace("0.5", "0.4"))))
    first = repo.promote("a", c.commit, 0.90, (c.candidate_hash, c.semantic_hash), seed.hash, "t")
    second = repo.promote("b", d.commit, 0.85, (d.candidate_hash, d.semantic_hash), seed.hash, "t")
    assert first.promoted and not second.promoted, "b is better, but lacks a's change"
    assert second.reason == "MasterMoved" and "moved to" in second.message
    assert repo.master().experiment == "a" and repo.master().val_bpb == 0.90
    again = repo.promote("a", c.commit, 0.90, (c.candidate_hash, c.semantic_hash), seed.hash, "t")
    assert again.promoted, "promoting the master again is a no-op that reports success"
    assert len(repo.master_doc()["history"]) == 2


def test_candidates_checked_in_several_threads_at_once_all_hash(tmp_path):
    """The operator's handler threads and the local loop check candidates at the same time.

    On CPython 3.11 two threads inside `ast.parse` at once could fail with "SystemError: AST
    constructor recursion depth mismatch" (gh-106905), which failed a whole reconcile pass.
    A garbage-collector callback that sleeps hands the GIL to another thread in the middle of
    the AST's construction, which is where the shared counter went wrong; every thread must
    still get the hash.
    """
    import gc
    import threading
    import time

    from controller.core.hashing import semantic_hash

    source = (Path(__file__).resolve().parents[1] / "bench" / "train.py").read_text()
    expected = semantic_hash(source)
    results: list[object] = []

    def switch_threads(phase, info):
        if phase == "start":
            time.sleep(0.0001)

    def check_many():
        for _ in range(15):
            try:
                results.append(semantic_hash(source))
            except SystemError as e:  # what the race raised
                results.append(e)

    threshold = gc.get_threshold()
    gc.set_threshold(50)
    gc.callbacks.append(switch_threads)
    try:
        threads = [threading.Thread(target=check_many) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.callbacks.remove(switch_threads)
        gc.set_threshold(*threshold)
    assert results == [expected] * 45


# Sources whose statements sit oddly on their lines: each must hash as `ast.dump` of the whole.
ODD_SOURCES = [
    SURFACE,
    "",
    "x = 1; y = 2\nx = 1; y = 3\n",                      # two statements on one line
    "@dec\ndef f():\n    return 1\n\ndef f():\n    return 1\n",  # same def, with and without
    "@(\n    dec)\nclass A:\n    pass\n",                # a decorator opening on the line above
    "s = '''a\nb'''\r\nt = 1\rz = 'é' + \\\n    'ü'\n",  # CR, CRLF, continuation, non-ASCII
    "\x0cx = 1\nif x:\n    y = 2\nelse:\n    y = 3\n",  # a form feed, a compound statement
]


@pytest.mark.parametrize("source", ODD_SOURCES)
def test_semantic_hash_is_the_hash_of_the_whole_ast_dump(source):
    """Ledger rows and masters carry sha1(ast.dump(tree)): the memoised hash must equal it."""
    import ast
    import hashlib

    from controller.core.hashing import semantic_hash

    expected = hashlib.sha1(ast.dump(ast.parse(source)).encode("utf-8")).hexdigest()
    assert semantic_hash(source) == expected
    assert semantic_hash(source) == expected, "the second time, from remembered statements"


def test_candidates_of_one_master_dump_only_the_statements_they_change(monkeypatch):
    """A check's semantic hash dumps the statements the diff touched, not the whole file."""
    import ast

    from controller.core import hashing

    source = (Path(__file__).resolve().parents[1] / "bench" / "train.py").read_text()
    hashing.semantic_hash(source)
    dumped: list[str] = []
    real = ast.dump
    monkeypatch.setattr(ast, "dump", lambda node, *a, **k: dumped.append(type(node).__name__)
                        or real(node, *a, **k))
    changed = source.replace("SEED = 42", "SEED = 1042", 1)
    assert changed != source
    hashing.semantic_hash(changed)
    assert dumped == ["Assign"]


def test_a_check_compiles_and_parses_only_the_lines_it_changed(repo, monkeypatch):
    """What a check costs is Python's parser and compiler: only the statement its diff
    changed is parsed into a tree, and only that tree is compiled; the master's statements
    were parsed and compiled when it was checked."""
    import ast
    import builtins

    from controller.core.hashing import compiled_semantic_hash

    compiled_semantic_hash(SURFACE, repo.lab.surface)  # as the master's own check did
    parsed: list[str] = []
    compiled: list[str] = []
    real_parse, real_compile = ast.parse, builtins.compile

    def parse(source, *a, **k):
        parsed.append(source)
        return real_parse(source, *a, **k)

    def compile_(source, filename, mode="exec", flags=0, *a, **k):
        if filename == repo.lab.surface and not flags & ast.PyCF_ONLY_AST:  # not ast.parse's
            compiled.append("text" if isinstance(source, (str, bytes)) else
                            ast.unparse(source))
        return real_compile(source, filename, mode, flags, *a, **k)

    monkeypatch.setattr(ast, "parse", parse)
    monkeypatch.setattr(builtins, "compile", compile_)
    changed = SURFACE.replace("0.02", "0.03")
    c = repo.materialise("e1", spec(repo, udiff(SURFACE, changed)))
    assert not c.refusal
    assert parsed == [line for line in changed.splitlines() if "0.03" in line]
    assert compiled == [ast.unparse(real_parse(parsed[0]))]
    monkeypatch.undo()
    assert c.semantic_hash == hashlib.sha1(ast.dump(ast.parse(changed)).encode()).hexdigest()


# Lines that join or split statements when dropped into a file: blocks continued or closed,
# decorators, brackets, strings and continuations left open, statements sharing a line.
TRICKY_LINES = ["    y = 3", "else:", "x = 1", "@dec", "def g():", "    return 2", "'''", "x = (",
                ")", "# a comment", "", "if x:", "z = 1 + \\", "class K:", "    pass", "try:",
                "except Exception:", "finally:", "a = 1; b = 2", "elif x:", "\tq = 1", "\x0cw = 2",
                "s = '''one", "two'''", "@(", "    dec)", "match x:", "    case 1:", "        pass",
                "x = 1\r", "t = '''a\r\nb'''"]


def test_the_semantic_hash_of_any_edit_is_the_hash_of_its_whole_ast():
    """Edits that a diff can make, lines inserted, replaced or deleted anywhere, often where
    they join a statement to the lines around it: whenever the result parses, the hash that
    parsed only what changed is sha1(ast.dump(ast.parse(text))); otherwise it does not compile."""
    import ast
    import random

    from controller.core.hashing import compile_source, semantic_hash

    base = (Path(__file__).resolve().parents[1] / "bench" / "train.py").read_text()
    semantic_hash(base)
    rng = random.Random(15)
    lines = base.split("\n")
    parsed = 0
    for _ in range(400):
        new = list(lines)
        for _ in range(rng.choice((1, 1, 2, 3))):
            at = rng.randrange(len(new) + 1)
            what = rng.choice(("insert", "replace", "delete", "indent"))
            if what == "insert":
                new.insert(at, rng.choice(TRICKY_LINES))
            elif at < len(new) and what == "replace":
                new[at] = rng.choice(TRICKY_LINES)
            elif at < len(new) and what == "delete":
                del new[at]
            elif at < len(new):
                new[at] = "    " + new[at]
        text = "\n".join(new)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            with pytest.raises(SyntaxError):
                compile_source(text, "bench/train.py")
            continue
        parsed += 1
        assert semantic_hash(text) == hashlib.sha1(ast.dump(tree).encode()).hexdigest(), text
    assert parsed > 100  # the edits that keep a file valid are what the shortcut must get right


# Lines the parser takes and the compiler may not: errors Python raises only once the whole
# module is compiled (a name declared global after it was used, a late __future__ import),
# errors of a statement on its own, and declarations that are fine where they stand.
COMPILER_LINES = ["global MATRIX_LR", "global fresh_name", "fresh_name = 1", "x: int = 1",
                  "global x", "from __future__ import annotations", "return 1", "break",
                  "continue", "nonlocal q", "yield 2", "await q", "def f():\n    nonlocal q",
                  "def f():\n    global g\n    g = 1", "class C:\n    return 3",
                  "from os import *", "def f():\n    from os import *", "print(x)",
                  "def f(a, a): pass", "__debug__ = 1", "f(x for x in y, 1)", "x = 1"]


def test_a_check_refuses_exactly_what_python_refuses_to_compile():
    """A check compiles only the statements it changed when that gives Python's verdict on
    the whole file. Edits that a diff can make, near the master's statements or at the top
    of the file, with lines only the compiler refuses, some only in the context of the
    module (a `global` after the name was assigned, a `from __future__` that is not first):
    whenever compiling the whole text raises, the check raises the same error at the same
    line; whenever it compiles, the check gives the hash of its whole tree."""
    import ast
    import random

    from controller.core.hashing import compiled_semantic_hash

    base = (Path(__file__).resolve().parents[1] / "bench" / "train.py").read_text()
    compiled_semantic_hash(base, "bench/train.py")
    rng = random.Random(16)
    lines = base.split("\n")
    verdicts = {"compiles": 0, "refused": 0}
    for _ in range(300):
        new = list(lines)
        for _ in range(rng.choice((1, 1, 2))):
            at = rng.choice((0, rng.randrange(len(new) + 1), rng.randrange(len(new) + 1)))
            if rng.random() < 0.5 and at < len(new):
                new[at] = rng.choice(COMPILER_LINES + TRICKY_LINES[:6])
            else:
                new.insert(at, rng.choice(COMPILER_LINES))
        text = "\n".join(new)
        try:
            ast.parse(text)
        except SyntaxError:
            continue  # the parser's own errors: the previous test
        try:
            compile(text, "bench/train.py", "exec", dont_inherit=True)
        except SyntaxError as whole:
            verdicts["refused"] += 1
            with pytest.raises(SyntaxError) as got:
                compiled_semantic_hash(text, "bench/train.py")
            assert (got.value.msg, got.value.lineno) == (whole.msg, whole.lineno), text
            continue
        verdicts["compiles"] += 1
        assert compiled_semantic_hash(text, "bench/train.py") == hashlib.sha1(
            ast.dump(ast.parse(text)).encode()).hexdigest()
    assert verdicts["compiles"] > 40 and verdicts["refused"] > 60, verdicts


@pytest.mark.parametrize("master, candidate, error", [
    ("x = 1\ny = 2\n", "x = 1\ny = 2\nglobal x\n",
     "name 'x' is assigned to before global declaration"),
    ("x = 1\nprint(x)\n", "x = 1\nglobal y\nprint(x)\ny = 3\n", None),
    ("y = 1\nglobal x\n", "y = 1\nx = 2\nglobal x\n",  # the master's declaration
     "name 'x' is assigned to before global declaration"),
    ("print(x)\nz = 1\n", "print(x)\nz = 1\nglobal x\n",
     "name 'x' is used prior to global declaration"),
    ("x: int = 1\nz = 2\n", "x: int = 1\nz = 2\nglobal x\n", "annotated name 'x' can't be global"),
    ('"""doc"""\nfrom __future__ import annotations\nx = 1\n',
     '"""doc"""\nfrom __future__ import annotations\nx = 1\nfrom __future__ import division\n',
     "from __future__ imports must occur at the beginning of the file"),
    ("x = 1\ny = 2\n", "x = 1\nreturn y\ny = 2\n", "'return' outside function"),
])
def test_a_declaration_that_reaches_across_the_module_is_compiled_with_all_of_it(
        master, candidate, error):
    """The statements a check does not compile again are the ones a module-wide declaration
    can make wrong: a check of a module with one compiles all of it."""
    from controller.core.hashing import compiled_semantic_hash

    compiled_semantic_hash(master, "bench/train.py")
    if error is None:
        compiled_semantic_hash(candidate, "bench/train.py")
        return
    with pytest.raises(SyntaxError, match=error):
        compiled_semantic_hash(candidate, "bench/train.py")


def test_the_candidate_is_the_diff_applied_whatever_the_users_git_config(repo, tmp_path,
                                                                         monkeypatch):
    """The diff is applied by git outside the lab's repository: a user's global config that
    rewrites line ends or refuses whitespace on checkout must not change the candidate's
    bytes (what is hashed, run and committed is the diff applied, exactly)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("[core]\n\tautocrlf = true\n\teol = crlf\n"
                                     "[apply]\n\twhitespace = error\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)
    repo.close()  # its git processes start again, under this HOME
    changed = SURFACE.replace("WARMDOWN = 0.5", "WARMDOWN = 0.6   ")
    c = repo.materialise("e1", spec(repo, udiff(SURFACE, changed, "bench/train.py")))
    assert not c.refusal, c.message
    assert repo.candidate_source("e1") == changed
    from controller.core.hashing import candidate_hash
    assert c.candidate_hash == candidate_hash(changed)
    blob = subprocess.run(["git", "cat-file", "blob", f"autolab/exp/e1:bench/train.py"],
                          cwd=repo.root, capture_output=True).stdout
    assert blob == changed.encode()


def test_a_git_process_a_check_talks_to_that_died_is_started_again(repo):
    """A check writes objects and moves branches through long-lived git processes; one that
    died (killed, out of memory) costs the next check nothing but their start."""
    first = SURFACE.replace("0.02", "0.03")
    assert not repo.materialise("e1", spec(repo, udiff(SURFACE, first))).refusal
    for pipe in repo.plumbing()._all:
        pipe.proc.kill()
        pipe.proc.wait()
    second = SURFACE.replace("0.02", "0.04")
    c = repo.materialise("e2", spec(repo, udiff(SURFACE, second)))
    assert not c.refusal, c.message
    assert repo.candidate_source("e2") == second
    assert repo.candidate_source("e1") == first


def test_a_check_applies_the_diff_when_the_temporary_directory_is_inside_a_repository(
        repo, tmp_path, monkeypatch):
    """The scratch copy lies in the temporary directory, which a user may keep inside a git
    repository of their own: git must not find that repository, nor let its attributes or
    config (line ends rewritten on checkout) change the candidate's bytes."""
    import tempfile

    outer = tmp_path / "outer"
    (outer / "tmp").mkdir(parents=True)
    subprocess.run(["git", "init", "-q"], cwd=outer, check=True)
    (outer / ".gitattributes").write_text("* text eol=crlf\n")
    subprocess.run(["git", "config", "core.autocrlf", "true"], cwd=outer, check=True)
    monkeypatch.setattr(tempfile, "tempdir", str(outer / "tmp"))
    changed = SURFACE.replace("0.02", "0.03")
    c = repo.materialise("e1", spec(repo, udiff(SURFACE, changed)))
    assert not c.refusal, c.message
    blob = subprocess.run(["git", "cat-file", "blob", "autolab/exp/e1:bench/train.py"],
                          cwd=repo.root, capture_output=True).stdout
    assert blob == changed.encode()
