"""The evaluator refuses exported models that could forge val_bpb (bench/evaluate.py).

Each test builds a small nn.Module, exports it with the real
`prepare.export_model` (tiny profile), sometimes tampers with the archive as
hostile code could, and runs the real evaluator the way the harness does:
`python -I bench/evaluate.py ...` in a child process, on tiny synthetic data
prepared by `python bench/prepare.py --source synthetic` into a cache of its
own. The cheating models are the ones a candidate would try: peeking at the
next token where the old check did not look (all rows but row 0, a few
positions), reading the next row (its first token is the last target when
windows are scored in consecutive order), counting its calls to cheat after
the probes, and archives that run code when torch.export.load unpickles them.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import math
import os
import pickle
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

BENCH = Path(__file__).resolve().parents[1] / "bench"
FIXED_SEED = "5eed" * 8  # --seed for the test whose cheat is caught with probability < 1 (see there)


def _prepare_module(name: str) -> bool:
    return name == "prepare" or name.startswith("prepare_")


def _private_prepare():
    """prepare.py and its siblings imported anew under this environment (the tiny profile), then
    taken out of sys.modules again: this process's own `prepare`, if any, is left as it was."""
    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if _prepare_module(n)}
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("prepare")
    finally:
        sys.path.remove(str(BENCH))
        for n in [n for n in sys.modules if _prepare_module(n)]:
            del sys.modules[n]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Tiny synthetic data in a fresh cache, and a private import of prepare.py with the tiny profile."""
    cache = tmp_path_factory.mktemp("evaluator-cache")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLAB_")}
    env.update(AUTOLAB_CACHE=str(cache), AUTOLAB_BENCH_PROFILE="tiny")
    prep = subprocess.run([sys.executable, str(BENCH / "prepare.py"), "--source", "synthetic"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    with pytest.MonkeyPatch.context() as mp:
        for k in [k for k in os.environ if k.startswith("AUTOLAB_")]:
            mp.delenv(k)
        mp.setenv("AUTOLAB_CACHE", str(cache))
        mp.setenv("AUTOLAB_BENCH_PROFILE", "tiny")
        prepare = _private_prepare()
    data = prepare.load_prepared(prep.stdout.splitlines()[0])
    return types.SimpleNamespace(prepare=prepare, data=data, env=env, vocab=prepare.VOCAB_SIZE,
                                 rows=prepare.EVAL_BATCH_SIZE, seq_len=prepare.MAX_SEQ_LEN)


def export(harness, model: nn.Module, tmp_path: Path) -> Path:
    out = harness.prepare.export_model(model, {"num_steps": 0}, export_dir=tmp_path / "export")
    assert (out / "model.pt2").is_file()
    return out


def evaluate(harness, export_dir: Path, *extra: str) -> dict:
    out = export_dir.parent / "evaluation.json"
    proc = subprocess.run(
        [sys.executable, "-I", str(BENCH / "evaluate.py"), "--export-dir", str(export_dir),
         "--data-dir", str(harness.data.path), "--val-sha256", harness.data.sha256("val.bin"),
         "--token-bytes-sha256", harness.data.sha256("token_bytes.npy"), "--out", str(out), *extra],
        env=harness.env, cwd=export_dir.parent, capture_output=True, text=True, timeout=120,
    )
    result = json.loads(out.read_text())
    assert proc.returncode == (0 if result["ok"] else 1), proc.stderr
    return result


def consecutive_bpb(harness, model: nn.Module) -> float:
    """val_bpb as evaluate_bpb computed it before the strided order: windows in consecutive rows,
    each prediction scored over the text tokens (the special tokens' logits at -inf)."""
    tokens = torch.from_numpy(harness.data.tokens("val").astype("int64"))
    table = torch.from_numpy(harness.data.token_bytes().astype("int64"))
    special = table == 0
    rows, seq_len = harness.rows, harness.seq_len
    windows = min(harness.prepare.EVAL_TOKENS, len(tokens) - 1) // seq_len
    nats, nbytes = 0.0, 0
    with torch.no_grad():
        for first in range(0, windows, rows):
            w = torch.tensor([min(first + r, windows - 1) for r in range(rows)])
            window = tokens[w[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]]
            logits = model(window[:, :-1]).masked_fill(special, float("-inf"))
            ce = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten(), reduction="none")
            b = table[window[:, 1:]].flatten() * torch.tensor([first + r < windows for r in range(rows)]).repeat_interleave(seq_len)
            nats += float(torch.where(b > 0, ce.double(), 0.0).sum())
            nbytes += int(b.sum())
    return nats / (math.log(2) * nbytes)


# --- the models ---------------------------------------------------------------------------------


class Causal(nn.Module):
    """Honest: position t sees the running mean of the embeddings of tokens 0..t."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, 32)
        self.head = nn.Linear(32, vocab)

    def forward(self, idx):
        e = self.emb(idx)
        count = torch.arange(1, idx.size(1) + 1, device=idx.device, dtype=e.dtype)[None, :, None]
        return self.head(e + e.cumsum(1) / count)

    def peek(self, idx):
        """30 nats on the next token of the same row: the target, read from the input."""
        return 30.0 * F.one_hot(torch.roll(idx, -1, dims=1), self.vocab).float()


class CausalInRegions(Causal):
    """Honest, with the regions a CUDA export holds: a bf16 autocast region (here on the CPU) and no_grad."""

    def forward(self, idx):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = super().forward(idx)
        with torch.no_grad():
            return logits.float() * 1.0


class PeekButRowZero(Causal):
    """Peeks everywhere except row 0, the only row the old check looked at."""

    def forward(self, idx):
        row = torch.arange(idx.size(0), device=idx.device)[:, None, None]
        return super().forward(idx) + (row != 0).float() * self.peek(idx)


class PeekAtFewPositions(Causal):
    """Peeks only at positions 100..120 of every row."""

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)[None, :, None]
        return super().forward(idx) + ((pos >= 100) & (pos <= 120)).float() * self.peek(idx)


class ReadsNextRow(Causal):
    """At the last position, boosts the first token of the next row: the target, in consecutive order."""

    def forward(self, idx):
        nxt = F.one_hot(torch.roll(idx[:, 0], -1, dims=0), self.vocab).float()[:, None, :]
        last = (torch.arange(idx.size(1), device=idx.device) == idx.size(1) - 1).float()[None, :, None]
        return super().forward(idx) + 30.0 * last * nxt


class CountsCalls(Causal):
    """Honest for its first two calls (where a probe would look), then peeks: state in a buffer."""

    def __init__(self, vocab: int, persistent: bool) -> None:
        super().__init__(vocab)
        self.register_buffer("calls", torch.zeros(()), persistent=persistent)

    def forward(self, idx):
        self.calls.add_(1)
        return super().forward(idx) + (self.calls > 2).float() * self.peek(idx)


# --- honest and cheating programs ---------------------------------------------------------------


@pytest.mark.parametrize("honest", [Causal, CausalInRegions], ids=["plain", "autocast-and-no-grad-regions"])
def test_an_honest_causal_model_scores_what_consecutive_windows_give(harness, tmp_path, honest):
    model = honest(harness.vocab)
    result = evaluate(harness, export(harness, model, tmp_path))
    assert result["ok"] and result["reason_code"] == "Succeeded", result
    assert set(result) == {"ok", "val_bpb", "num_params", "flops_per_token", "depth", "eval_seconds",
                           "device", "device_name", "reason_code", "causality_max_nats", "stage_seconds",
                           "ready_seconds"}
    assert result["flops_per_token"] > 0 and result["device_name"] is None  # the CPU has no name
    assert result["causality_max_nats"] <= 1e-4  # honest rows are bit-equal in both passes
    assert result["num_params"] == sum(p.numel() for p in model.parameters())
    assert result["val_bpb"] == pytest.approx(consecutive_bpb(harness, model), rel=1e-6)


@pytest.mark.parametrize("cheat", [PeekButRowZero, PeekAtFewPositions], ids=["all-rows-but-0", "positions-100-120"])
def test_a_model_that_peeks_anywhere_is_not_causal(harness, tmp_path, cheat):
    # Every batch gets a perturbed copy, one cut per row; peeking at t is seen in a row cut at t+1.
    # Cuts are shuffled sweeps over 1..T; where the scored rows are fewer than T the evaluator runs
    # more perturbed copies until every position is a cut, so positions 101..121 are always among
    # them. The fixed seed keeps the position named deterministic. Peeking in all rows but row 0 is
    # caught by any seed.
    seed = ("--seed", FIXED_SEED) if cheat is PeekAtFewPositions else ()
    result = evaluate(harness, export(harness, cheat(harness.vocab), tmp_path), *seed)
    assert not result["ok"] and result["blame"] == "candidate", result
    assert result["reason_code"] == "NotCausal" and "not causal" in result["reason"]
    assert "batch" in result["reason"] and "row" in result["reason"] and "position" in result["reason"]
    if cheat is PeekAtFewPositions:  # the position named is one where it peeks
        assert 100 <= int(re.search(r"at position (\d+) moved", result["reason"]).group(1)) <= 120


def test_a_model_that_reads_the_next_row_is_caught_or_gains_nothing(harness, tmp_path):
    honest, leaky = Causal(harness.vocab), ReadsNextRow(harness.vocab)
    assert consecutive_bpb(harness, leaky) < consecutive_bpb(harness, honest)  # the leak pays in the old order
    result = evaluate(harness, export(harness, leaky, tmp_path))
    if result["ok"]:  # strided order: the next row is another part of the text; the permuted copy may see it
        assert result["val_bpb"] >= consecutive_bpb(harness, honest) * (1 - 1e-6)
    else:
        assert result["reason_code"] == "NotCausal", result


@pytest.mark.parametrize("persistent", [True, False], ids=["buffer", "non-persistent-buffer"])
def test_a_model_that_counts_its_calls_is_refused(harness, tmp_path, persistent):
    result = evaluate(harness, export(harness, CountsCalls(harness.vocab, persistent), tmp_path))
    assert not result["ok"] and result["reason_code"] == "ExportRefused", result
    assert "changes its own state" in result["reason"] and "calls" in result["reason"]


# --- archives that would run code, or write outside their folder, when loaded ------------------


class RunsOnUnpickle:
    """Unpickling this writes a marker file: what a hostile pickle in the archive would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",))


def tamper(export_dir: Path, edit) -> Path:
    """Rewrite model.pt2 after edit(members, root) changed its {name: bytes}; returns the archive."""
    path = export_dir / "model.pt2"
    with zipfile.ZipFile(path) as zf:
        members = {info.filename: zf.read(info) for info in zf.infolist()}
    edit(members, next(iter(members)).split("/")[0])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _edit_json(members: dict, name: str, change) -> None:
    doc = json.loads(members[name])
    change(doc)
    members[name] = json.dumps(doc).encode()


def pickled_weight(marker):
    def edit(members, root):
        config = f"{root}/data/weights/model_weights_config.json"
        entry = next(iter(json.loads(members[config])["config"].values()))
        _edit_json(members, config, lambda d: next(iter(d["config"].values())).update(use_pickle=True))
        members[f"{root}/data/weights/{entry['path_name']}"] = pickle.dumps(RunsOnUnpickle(marker), protocol=2)
    return edit


def pickled_sample_inputs(marker):
    def edit(members, root):
        members[f"{root}/data/sample_inputs/model.pt"] = pickle.dumps(RunsOnUnpickle(marker), protocol=2)
    return edit


def pickled_opaque_constant(marker):
    def edit(members, root):
        config = f"{root}/data/constants/model_constants_config.json"
        entry = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        _edit_json(members, config, lambda d: d["config"].update(evil=entry))
        members[f"{root}/data/constants/opaque_obj_0"] = pickle.dumps(RunsOnUnpickle(marker), protocol=2)
    return edit


PICKLES = {  # variant -> (edit, words of the refusal); each one runs its payload under plain torch.export.load
    "weight": (pickled_weight, "use_pickle"),
    "sample-inputs": (pickled_sample_inputs, "sample_inputs"),
    "opaque-constant": (pickled_opaque_constant, "opaque_obj_0"),
}


@pytest.mark.parametrize("variant", PICKLES)
def test_an_archive_with_a_pickle_is_refused_unopened(harness, tmp_path, variant):
    make_edit, words = PICKLES[variant]
    decoy = tmp_path / "decoy"
    export_dir = export(harness, Causal(harness.vocab), tmp_path / "decoy-export")
    archive = tamper(export_dir, make_edit(decoy))
    with contextlib.suppress(Exception):  # the threat is real: torch's own loader runs the payload
        torch.export.load(str(archive))
    assert decoy.read_text() == "unpickled"

    marker = tmp_path / "marker"
    export_dir = export(harness, Causal(harness.vocab), tmp_path)
    tamper(export_dir, make_edit(marker))
    result = evaluate(harness, export_dir)
    assert not result["ok"] and result["blame"] == "candidate" and result["reason_code"] == "ExportRefused"
    assert words in result["reason"], result["reason"]
    assert not marker.exists()


def _first_node(doc: dict) -> dict:
    return doc["graph_module"]["graph"]["nodes"][0]


GRAPHS = {  # variant -> (change to model.json given the marker path, words of the refusal)
    "guards-code": (lambda m: lambda d: d.update(guards_code=[f"open({str(m)!r}, 'w').write('x') or True"]),
                    "guards_code"),
    "python-callable": (lambda m: lambda d: _first_node(d).update(target="torch.serialization.os.system"),
                        "torch.serialization.os.system"),
    "file-reading-op": (lambda m: lambda d: _first_node(d).update(target="torch.ops.aten.from_file.default"),
                        "from_file"),
    "sympy-expression": (lambda m: lambda d: d["graph_module"]["graph"]["sym_int_values"].update(
        s0={"as_expr": {"expr_str": f"__import__('os').system('touch {m}')", "hint": None}}), "sym_int_values"),
}


@pytest.mark.parametrize("variant", GRAPHS)
def test_a_graph_that_would_run_code_is_refused(harness, tmp_path, variant):
    change, words = GRAPHS[variant]
    marker = tmp_path / "marker"
    export_dir = export(harness, Causal(harness.vocab), tmp_path)
    tamper(export_dir, lambda members, root: _edit_json(members, f"{root}/models/model.json", change(marker)))
    result = evaluate(harness, export_dir)
    assert not result["ok"] and result["reason_code"] == "ExportRefused", result
    assert words in result["reason"], result["reason"]
    assert not marker.exists()


@pytest.mark.parametrize("name", ["{root}/../../escape.txt", "../escape.txt", "/tmp/escape.txt",
                                  "{root}/data/aotinductor/model/model.so", "{root}/extra/notes.txt",
                                  "other-root/models/model.json"])
def test_an_archive_with_a_member_outside_its_layout_is_refused(harness, tmp_path, name):
    export_dir = export(harness, Causal(harness.vocab), tmp_path)
    tamper(export_dir, lambda members, root: members.update({name.format(root=root): b"x"}))
    result = evaluate(harness, export_dir)
    assert not result["ok"] and result["reason_code"] == "ExportRefused", result
    assert not (tmp_path / "escape.txt").exists() and not Path("/tmp/escape.txt").exists()


# --- the evaluator that gets ready while the candidate starts up (--export-dir -) -----------------

# The evaluator and its attacker share a uid and neither has CAP_SYS_PTRACE: as root, setpriv takes
# it out of the bounding set (root has it otherwise, and with it every /proc file); as another user,
# the process has no capability at all. This interpreter, whatever directory it lives under, serves
# both (another uid could not read a clone under a 0700 directory).
AS_SAME_UID = (["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-all", "--"] if os.geteuid() == 0 else [])


def test_a_waiting_evaluator_takes_its_export_from_stdin_and_no_process_of_its_uid_can_write_there(
        harness, tmp_path):
    """An evaluator started early lives while the candidate runs. Where the candidate has its
    uid (a run without a sandbox), /proc/<pid>/fd/0 would let it name an export of its own:
    the waiting evaluator makes itself non-dumpable (before it gets ready, which it tells), so
    opening its stdin fails for a process of its uid. Handed the real directory, it measures
    what an honest model scores."""
    import tempfile
    import time

    model = Causal(harness.vocab)
    export(harness, model, tmp_path)
    # A world-readable copy of the data and the export (pytest's tmp_path is root's alone).
    shared = Path(tempfile.mkdtemp(prefix="autolab-early-eval-"))
    try:
        os.chmod(shared, 0o755)
        for name in ("val.bin", "token_bytes.npy"):
            shutil.copy(harness.data.path / name, shared / name)
        shutil.copytree(tmp_path / "export", shared / "export")
        for p in [shared, *shared.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        work = shared / "work"
        work.mkdir(mode=0o777)
        os.chmod(work, 0o777)
        out, ready = work / "evaluation.json", work / "ready"
        proc = subprocess.Popen(
            [*AS_SAME_UID, sys.executable, "-I", str(BENCH / "evaluate.py"), "--export-dir", "-",
             "--data-dir", str(shared), "--val-sha256", harness.data.sha256("val.bin"),
             "--token-bytes-sha256", harness.data.sha256("token_bytes.npy"), "--out", str(out),
             "--tell-ready", str(ready)],
            env={**{k: v for k, v in harness.env.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))},
                 "HOME": str(work), "TMPDIR": str(work), "AUTOLAB_CACHE": str(work)},
            cwd=work, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            # It is non-dumpable before it gets ready, and says when it is ready.
            deadline = time.monotonic() + 120
            while not ready.exists():
                assert proc.poll() is None and time.monotonic() < deadline, "the evaluator never got ready"
                time.sleep(0.05)
            attack = subprocess.run(
                [*AS_SAME_UID, sys.executable, "-I", "-c",
                 "import sys\ntry:\n    open(sys.argv[1], 'w').write(sys.argv[2] + '\\n')\n"
                 "except OSError as e:\n    print(type(e).__name__)\nelse:\n    print('WROTE')",
                 f"/proc/{proc.pid}/fd/0", str(shared / "forged")],
                capture_output=True, text=True, timeout=60)
            assert attack.stdout.strip() == "PermissionError", attack
            proc.communicate(f"{shared / 'export'}\n".encode(), timeout=120)
        finally:
            proc.kill()
            proc.wait()
        early = json.loads(out.read_text())
        assert early["ok"], early
        assert early["val_bpb"] == pytest.approx(consecutive_bpb(harness, model), rel=1e-6)
        assert {"data", "import"} <= set(early["ready_seconds"]) and "score" in early["stage_seconds"]
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_a_waiting_evaluator_told_nothing_writes_nothing(harness, tmp_path):
    """The run ended before an export (a crash, a refusal): end of input, and no verdict."""
    out = tmp_path / "evaluation.json"
    proc = subprocess.run(
        [sys.executable, "-I", str(BENCH / "evaluate.py"), "--export-dir", "-",
         "--data-dir", str(harness.data.path), "--val-sha256", harness.data.sha256("val.bin"),
         "--token-bytes-sha256", harness.data.sha256("token_bytes.npy"), "--out", str(out)],
        env=harness.env, cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not out.exists(), proc.stderr


def test_the_rehearsal_loads_checks_and_runs_its_toy(harness, tmp_path):
    """A waiting evaluator on a GPU rehearses an evaluation with a toy program of its own (the
    first load, checks and run of a process pay for what the real evaluation then reuses). Here
    on the CPU, in a fresh process, with and without the bf16 autocast a GPU export runs under:
    the toy passes the same checks an export must pass. (Exported under an autocast outside the
    program, as it first was, its run_decompositions failed on every GPU and the rehearsal was
    skipped without anyone noticing.)"""
    for autocast in (False, True):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); import evaluate; "
                f"evaluate.rehearse('cpu', autocast={autocast}); print('ok')")
        proc = subprocess.run([sys.executable, "-I", "-c", code, str(BENCH)], env=harness.env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and proc.stdout.strip() == "ok", (autocast, proc.stderr)


def test_the_batched_causality_comparison_is_each_rows_own_up_to_its_cut(harness, tmp_path):
    """The probe compares a whole batch at once (compiled, on a GPU); what it finds for each row
    must be what that row's positions before its cut give alone, infinities and NaNs included,
    and nothing from the cut on."""
    code = r"""
import math, sys
sys.path.insert(0, sys.argv[1])
import torch, evaluate
g = torch.Generator().manual_seed(0)
a = torch.randn(4, 16, 32, generator=g)
b = a.clone()
b[1, 9:] += torch.randn(7, 32, generator=g)              # row 1 changes from position 9 on
b[2, 3, 5] += 0.5                                         # row 2 moves at position 3 only
a[3, 2, 0], b[3, 2, 0] = math.inf, math.inf               # equal infinities: no move
a[3, 4, 1] = math.nan                                     # a NaN against a number: an infinite move
cuts = [16, 9, 16, 12]
got = evaluate._moved_before_cut(a, b, torch.tensor(cuts))
for r, cut in enumerate(cuts):
    alone = evaluate._moved(a[r, :cut].log_softmax(-1), b[r, :cut].log_softmax(-1))
    assert torch.allclose(got[r, :cut], alone, atol=1e-6, rtol=0), (r, got[r, :cut], alone)
    assert not got[r, cut:].any(), (r, got[r, cut:])
assert got[0].max() == 0 and got[1].max() == 0           # row 1's change is all after its cut
assert got[2, 3] > 0.1 and got[2, :3].max() == 0 and got[2, 4:].max() == 0
assert got[3, 2] == 0 and math.isinf(got[3, 4])
print("ok")
"""
    proc = subprocess.run([sys.executable, "-I", "-c", code, str(BENCH)], env=harness.env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# --- functionalisation: skipped only where it would find nothing ---------------------------------


class WritesAnIntermediate(Causal):
    """Honest, with an in-place write to a tensor of its own making (nothing kept between calls)."""

    def forward(self, idx):
        logits = super().forward(idx).clone()
        logits.mul_(1.0)
        return logits


class LayerNormed(Causal):
    """Honest, through a composite operator outside the plain few (layer_norm)."""

    def forward(self, idx):
        return F.layer_norm(super().forward(idx), (self.vocab,))


class DropoutInTraining(Causal):
    """Draws random numbers on every call, hidden in a composite operator (dropout, training on)."""

    def forward(self, idx):
        return F.dropout(super().forward(idx), 0.5, training=True)


class AddsNoise(Causal):
    """Draws random numbers with an operator of its own kernel (rand_like)."""

    def forward(self, idx):
        logits = super().forward(idx)
        return logits + torch.rand_like(logits)


def _evaluator_module():
    spec = importlib.util.spec_from_file_location("evaluate_for_tests", BENCH / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_a_program_that_may_write_or_hide_an_operator_is_retraced(harness, tmp_path, monkeypatch):
    """check_program re-traces a program (run_decompositions, ~1.8 s of a tiny run's CPU) only
    when that could show something: an operator that writes to a tensor, or a composite one
    outside the plain few train.py's model uses. train.py's own model and a plain causal one are
    checked as they are; another composite, or a write to an intermediate, is re-traced and
    passes; a write to a buffer is re-traced and refused."""
    E = _evaluator_module()
    retraced = []
    real = torch.export.ExportedProgram.run_decompositions

    def counted(self, *args, **kwargs):
        retraced.append(True)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions", counted)

    def check(model, name: str) -> int:
        retraced.clear()
        out = export(harness, model, tmp_path / name)
        E.check_program(E.load_program(E.check_archive(E.read_archive(out / "model.pt2"))),
                        harness.rows, harness.seq_len)
        return len(retraced)

    source = (BENCH / "train.py").read_text()
    scope = {"__name__": "train_model_only", "__file__": str(BENCH / "train.py")}
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setenv("AUTOLAB_BENCH_PROFILE", "tiny")
    monkeypatch.setenv("AUTOLAB_CACHE", harness.env["AUTOLAB_CACHE"])  # the fixture's data, not ~/.cache's
    monkeypatch.setitem(sys.modules, "prepare", harness.prepare)
    exec(compile(source[:source.index("model = torch.compile(")], "train.py", "exec"), scope)
    assert check(scope["raw_model"], "train") == 0
    assert check(Causal(harness.vocab), "causal") == 0
    assert check(LayerNormed(harness.vocab), "layer-norm") == 1
    assert check(WritesAnIntermediate(harness.vocab), "intermediate") == 1
    with pytest.raises(E.Failure, match="changes its own state"):
        check(CountsCalls(harness.vocab, True), "counts")
    assert retraced


@pytest.mark.parametrize("model", [DropoutInTraining, AddsNoise], ids=["dropout-in-training", "rand-like"])
def test_a_model_that_draws_random_numbers_is_refused(harness, tmp_path, model):
    result = evaluate(harness, export(harness, model(harness.vocab), tmp_path))
    assert not result["ok"] and result["reason_code"] == "ExportRefused", result
    assert "draws random numbers" in result["reason"], result["reason"]


# --- state outside the module's tensors, and tensors the evaluator cannot copy -----------------


class StashesInFreedMemory(Causal):
    """Cheats on the scored batch and passes the probe with state kept in uninitialised memory.

    Each call writes [MAGIC, checksum, the batch it takes as original] into K fresh int64 tensors of a size
    nothing else uses, which die at the end of the call; the K torch.empty of the next call get those
    chunks back from the allocator, bytes intact (glibc). The probe's perturbed copy finds the scored
    batch there (one of its rows is whole), maps each of its rows to the original by longest common prefix
    and adds the same +30 nats on the original next token: every position before a cut is unchanged.
    Without the refusal of aten.empty this scored about 0.05 bits per byte against the honest model's 2.9.
    """

    K, OFF, MAGIC = 16, 32, 0x5EED_C0DE_1234

    def forward(self, idx):
        B, T = idx.shape
        N, OFF, K, V = B * T, self.OFF, self.K, self.vocab
        S = 2 * OFF + 2 + N
        w = torch.arange(1, N + 1, dtype=torch.int64).view(B, T)
        raws = torch.stack([torch.empty(S, dtype=torch.int64) for _ in range(K)])  # last call's stashes
        datas, oks = [], []
        for k in range(K):
            raw = raws[k]
            hit = raw[: 2 * OFF] == self.MAGIC
            p = torch.argmax(hit.to(torch.int64))
            data = raw[(p + 2 + torch.arange(N)).clamp(max=S - 1)].clamp(0, V - 1).view(B, T)
            chk = raw[(p + 1).clamp(max=S - 1).view(1)].sum()
            eq = idx[:, None, :] == data[None, :, :]
            oks.append(hit.any() & (chk == (data * w).sum()) & eq.all(-1).any())
            datas.append(data)
        oks = torch.stack(oks)
        perturbed = oks.any()
        data = torch.stack(datas).index_select(0, torch.argmax(oks.to(torch.int64)).view(1))[0]
        lcp = (idx[:, None, :] == data[None, :, :]).to(torch.int64).cumprod(-1).sum(-1)
        src = torch.where(perturbed, data[lcp.argmax(-1)], idx)
        keep = torch.where(perturbed, data, idx)
        pos = torch.arange(T)[None, :, None]
        mask = ((pos >= 1) & (pos < T - 1)).float()
        logits = super().forward(idx) + 30.0 * mask * F.one_hot(torch.roll(src, -1, dims=1), V).float()
        body = torch.cat([torch.tensor([self.MAGIC]), (keep * w).sum().view(1), keep.flatten()])
        z = torch.zeros(OFF, dtype=torch.int64)
        stashes = [torch.cat([z, body, z]) for _ in range(K)]  # all alive until the end: K chunks
        return logits + (torch.stack([s[OFF] for s in stashes]).sum() * 0).float()


def test_a_model_that_keeps_state_in_uninitialised_memory_is_refused(harness, tmp_path):
    result = evaluate(harness, export(harness, StashesInFreedMemory(harness.vocab), tmp_path))
    assert not result["ok"] and result["reason_code"] == "ExportRefused", result
    assert "aten.empty" in result["reason"], result["reason"]


class HugeExpandedBuffer(Causal):
    """Honest, plus an unused buffer of 2**40 elements held in 4 bytes (a stride-0 view): the archive is
    small, but a dense copy of the buffer cannot be made."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.register_buffer("huge", torch.zeros(1).expand(2**20, 2**20))


def test_a_tensor_the_evaluator_cannot_copy_is_the_candidates_failure(harness, tmp_path):
    result = evaluate(harness, export(harness, HugeExpandedBuffer(harness.vocab), tmp_path))
    assert not result["ok"] and result["blame"] == "candidate", result  # was "harness": a free re-run
    assert result["reason_code"] == "ExportRefused" and "overlap" in result["reason"], result


class NoSpecials(Causal):
    """Causal, with no probability on the special tokens (their logits -inf). They are never
    targets that count (0 bytes), so before each prediction was scored over the text tokens
    alone this gained -log(1 - p(special)) on every scored token: about 1.5 % of val_bpb on
    the synthetic data, for nothing learned."""

    def __init__(self, vocab: int, special: torch.Tensor) -> None:
        super().__init__(vocab)
        self.register_buffer("special", special)

    def forward(self, idx):
        return super().forward(idx).masked_fill(self.special, float("-inf"))


def test_giving_the_special_tokens_no_probability_gains_nothing(harness, tmp_path):
    special = torch.from_numpy(harness.data.token_bytes().astype("int64")) == 0
    assert special.any()
    honest = evaluate(harness, export(harness, Causal(harness.vocab), tmp_path / "honest"))
    cheat = evaluate(harness, export(harness, NoSpecials(harness.vocab, special), tmp_path / "cheat"))
    assert honest["ok"] and cheat["ok"], (honest, cheat)
    assert cheat["val_bpb"] == pytest.approx(honest["val_bpb"], rel=1e-6), (cheat, honest)


class SlicedBuffer(Causal):
    """Honest, with a buffer that is a slice of a bigger tensor (a view with gaps): its dense copy
    is smaller than what it holds, nothing to refuse."""

    def __init__(self, vocab: int) -> None:
        super().__init__(vocab)
        self.register_buffer("part", torch.ones(64, 64)[:, :8])

    def forward(self, idx):
        return super().forward(idx) + 0.0 * self.part.sum()


def test_a_buffer_sliced_from_a_bigger_tensor_is_accepted(harness, tmp_path):
    result = evaluate(harness, export(harness, SlicedBuffer(harness.vocab), tmp_path))
    assert result["ok"], result
