"""The benchmark (bench/): data preparation, the run harness, the metric, anti-forgery.

Everything runs on the CPU with the tiny profile and a cache of its own. The
Hub is a local HTTP server that the real huggingface_hub client downloads
from. Candidates are real files run by the real harness in child processes.
"""

from __future__ import annotations

import hashlib
import http.server
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from controller.core import figures

BENCH = Path(__file__).resolve().parents[1] / "bench"
TRAIN = BENCH / "train.py"
BUDGET = 2.5  # training seconds per harness run in these tests
SUMMARY_KEYS = list(figures.SUMMARY_KEYS)  # the controller's; bench/run.py must print the same


@pytest.fixture(scope="session")
def bench(tmp_path_factory):
    """prepare and run, imported with the tiny profile and a fresh cache."""
    cache = tmp_path_factory.mktemp("autolab-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("AUTOLAB_CACHE", str(cache))
    mp.setenv("AUTOLAB_BENCH_PROFILE", "tiny")
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache / "compile"))
    for var in ("AUTOLAB_SOURCE", "AUTOLAB_DATA_DIR", "AUTOLAB_EXPORT_DIR", "AUTOLAB_CURVE_PATH",
                "AUTOLAB_TIME_BUDGET", "AUTOLAB_PREPARE_FAULT", "HF_HUB_OFFLINE", "HF_ENDPOINT"):
        mp.delenv(var, raising=False)
    mp.syspath_prepend(str(BENCH))
    if "prepare" in sys.modules:  # imported earlier with other settings
        prepare = importlib.reload(sys.modules["prepare"])
    else:
        prepare = importlib.import_module("prepare")
    spec = importlib.util.spec_from_file_location("autolab_bench_run", BENCH / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    evaluate = importlib.import_module("evaluate")
    assert prepare.PROFILE == "tiny"
    harness = types.SimpleNamespace(**{name.removeprefix("harness_"): module for name, module in sys.modules.items()
                                       if name.startswith("harness_")})  # run.py's modules, by concern
    yield types.SimpleNamespace(prepare=prepare, run=run, harness=harness, evaluate=evaluate, cache=cache)
    mp.undo()


def env_for(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOLAB_")}
    env.update(AUTOLAB_CACHE=str(cache), AUTOLAB_BENCH_PROFILE="tiny", **extra)
    return env


def harness(bench, candidate: Path, tmp_path: Path, source: str = "synthetic", **kw) -> dict:
    result = bench.run.run_candidate(candidate, tmp_path / "result.json", source=source,
                                     budget=kw.pop("budget", BUDGET), log_path=tmp_path / "run.log",
                                     termination_log=tmp_path / "termination-log", **kw)
    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk == result
    assert json.loads((tmp_path / "termination-log").read_text()) == result
    return result


def write_candidate(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / "candidate" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def untrained_bpb(bench, data) -> float:
    """val_bpb of a randomly initialised (bigram) model, through the same evaluate_bpb."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(bench.prepare.VOCAB_SIZE, 32),
                                torch.nn.Linear(32, bench.prepare.VOCAB_SIZE))
    return bench.prepare.evaluate_bpb(model, tokens=data.tokens("val"), token_bytes=data.token_bytes())


def assert_succeeded_below_untrained(bench, result: dict, source: str) -> None:
    assert result["status"] == "succeeded", result["reason"]
    assert result["exit_code"] == 0 and result["profile"] == "tiny"
    assert list(result["metrics"]) == SUMMARY_KEYS
    assert result["candidate_sha1"] == hashlib.sha1(TRAIN.read_bytes()).hexdigest()
    data = bench.prepare.prepare(source)
    bpb = result["metrics"]["val_bpb"]
    assert np.isfinite(bpb) and 0 < bpb < untrained_bpb(bench, data)
    curve = [json.loads(line) for line in Path(result["curve"]).read_text().splitlines()]
    assert curve and {"step", "loss", "tokens_per_sec"} <= set(curve[0])


# --- synthetic, text and parquet sources, end to end -------------------------------------------


def test_synthetic_candidate_succeeds_with_the_harness_metric_below_an_untrained_model(bench, tmp_path,
                                                                                       monkeypatch):
    # As on a GPU machine, the evaluator gets ready while the candidate starts up (every other
    # CPU run here starts it after training).
    monkeypatch.setenv("AUTOLAB_EARLY_EVALUATOR", "1")
    result = harness(bench, TRAIN, tmp_path)
    assert_succeeded_below_untrained(bench, result, "synthetic")
    assert result["source"] == "synthetic"
    assert 0 < result["metrics"]["training_seconds"] <= BUDGET + 60
    assert len(bench.run.compact(result).encode()) <= 4096
    log = (tmp_path / "run.log").read_text()
    assert "step 00001 | loss" in log and log.rstrip().splitlines()[-1].startswith("AUTOLAB_RESULT ")
    # Where the time went, in the result and in one line of the log.
    timing = result["timing"]
    parts = [timing[k] for k in ("prepare_seconds", "startup_seconds", "training_seconds",
                                 "export_seconds", "evaluate_seconds")]
    assert all(v >= 0 for v in parts) and sum(parts) <= result["metrics"]["total_seconds"] + 0.5
    line = next(x for x in log.splitlines() if "time: prepare" in x)
    assert re.search(r"start-up [\d.]+s, training [\d.]+s, export [\d.]+s, evaluate [\d.]+s "
                     r"\(read_archive [\d.]+ .*score [\d.]+.*\), "
                     r"other [\d.]+s; outside training [\d.]+s of [\d.]+s", line), line
    # ... and inside the evaluator: each stage after the export, together no more than the
    # evaluator's time after training; torch's import and the data were done while the
    # candidate started up.
    stages = timing["evaluate_stages"]
    assert list(stages)[:2] == ["read_archive", "load"] and "score" in stages, stages
    assert sum(stages.values()) <= timing["evaluate_seconds"] + 0.1
    assert "import" not in stages and {"data", "import"} <= set(timing["evaluator_ready"])


def test_run_by_hand_prints_the_summary_block(bench, tmp_path):
    cache = tmp_path / "cache"
    env = env_for(cache, AUTOLAB_TIME_BUDGET="2")
    prep = subprocess.run([sys.executable, "prepare.py", "--source", "synthetic"], cwd=BENCH, env=env,
                          capture_output=True, text=True, timeout=120)
    assert prep.returncode == 0, prep.stderr
    train = subprocess.run([sys.executable, "train.py"], cwd=BENCH, env=env, capture_output=True, text=True,
                           timeout=120)
    assert train.returncode == 0, train.stderr
    block = train.stdout.split("\n---\n")[-1].strip().splitlines()
    parsed = [re.fullmatch(r"(\w+):\s+(\S+)", line).groups() for line in block]
    assert [k for k, _ in parsed] == SUMMARY_KEYS
    assert all(len(line) - len(line.split()[-1]) == 18 for line in block)  # values start at column 18
    assert re.fullmatch(r"\d+\.\d{6}", parsed[0][1])
    assert float(parsed[0][1]) < 4.0


def write_text_corpus(root: Path) -> None:
    import random

    rng = random.Random(7)
    from prepare import _synthetic_document as make_doc  # the generator only; any text would do

    for i in range(80):
        suffix = [".txt", ".md", ".rst", ".py"][i % 4]
        sub = root / f"part{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        text = make_doc(rng)
        if suffix == ".py":
            text = "".join(f"# {line}\n" for line in text.splitlines()) + f"VALUE_{i} = {i}\n"
        (sub / f"doc{i:03d}{suffix}").write_text(text)
    with open(root / "lines.jsonl", "w") as f:
        for _ in range(300):
            f.write(json.dumps({"text": make_doc(rng), "meta": 1}) + "\n")
    (root / "ignored.bin").write_bytes(b"\x00\x01")


def write_parquet_shards(root: Path, names=("shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"),
                         docs_per_shard: int = 300) -> None:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    from prepare import _synthetic_document as make_doc

    root.mkdir(parents=True, exist_ok=True)
    for n, name in enumerate(names):
        rng = random.Random(n)
        table = pa.table({"text": [make_doc(rng) for _ in range(docs_per_shard)], "id": list(range(docs_per_shard))})
        pq.write_table(table, root / name, row_group_size=100)


@pytest.mark.parametrize("layout", ["text files", "parquet shards"])
def test_local_directory_candidate_succeeds(bench, tmp_path, layout):
    corpus = tmp_path / "corpus"
    write_text_corpus(corpus) if layout == "text files" else write_parquet_shards(corpus)
    source = f"dir:{corpus}"
    data = bench.prepare.prepare(source)
    if layout == "text files":
        held_out = data.manifest["val_documents"]
        assert held_out and "split" in data.manifest
        assert bench.prepare.prepare(source).manifest["val_documents"] == held_out  # deterministic
        assert not any(k.endswith("ignored.bin") for k in data.manifest["inputs"])
    else:
        assert data.manifest["splits"]["val"]["documents"] == 300
    result = harness(bench, TRAIN, tmp_path, source=source)
    assert_succeeded_below_untrained(bench, result, source)
    assert result["source"] == f"dir:{corpus.resolve()}"


# --- the metric -------------------------------------------------------------------------------


def test_the_same_weights_evaluate_to_the_same_bpb(bench, tmp_path):
    import torch

    data = bench.prepare.prepare("synthetic")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Embedding(bench.prepare.VOCAB_SIZE, 32),
                                torch.nn.Linear(32, bench.prepare.VOCAB_SIZE))
    export = bench.prepare.export_model(model, {"num_steps": 0}, export_dir=tmp_path / "export")
    shas = data.sha256("val.bin"), data.sha256("token_bytes.npy")
    first = bench.evaluate.evaluate(export, data.path, *shas)
    second = bench.evaluate.evaluate(export, data.path, *shas)
    assert first["val_bpb"] == second["val_bpb"]
    live = bench.prepare.evaluate_bpb(model, tokens=data.tokens("val"), token_bytes=data.token_bytes())
    assert live == pytest.approx(first["val_bpb"], rel=1e-6)


def test_bits_per_byte_counts_every_byte_of_the_text_once(bench):
    from tokenizers import Tokenizer

    data = bench.prepare.prepare("synthetic")
    tok = Tokenizer.from_file(str(data.file("tokenizer.json")))
    table = data.token_bytes()
    assert table[: len(bench.prepare.SPECIAL_TOKENS)].sum() == 0
    text = "Ada's favourite colour is amber. 12 + 30 = 42 — naïve café ☕\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert table[ids].sum() == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


# --- crash safety of the cache ----------------------------------------------------------------


def published(cache: Path) -> list[Path]:
    return [p for p in (cache / "data").iterdir() if p.is_dir() and not p.name.startswith(".")]


def test_the_synthetic_validation_text_is_secret_to_its_cache(bench, tmp_path, monkeypatch):
    """Code that cannot read the cache cannot regenerate the synthetic validation split."""
    ours = bench.prepare.prepare("synthetic")
    monkeypatch.setenv("AUTOLAB_CACHE", str(tmp_path / "elsewhere"))  # what a sandboxed candidate has
    theirs = bench.prepare.prepare("synthetic")
    assert (tmp_path / "elsewhere" / "synthetic.seed").stat().st_mode & 0o077 == 0
    seed = (bench.cache / "synthetic.seed").read_text().strip()
    assert not np.array_equal(ours.tokens("val")[:4096], theirs.tokens("val")[:4096])
    assert np.array_equal(ours.tokens("train")[:4096], theirs.tokens("train")[:4096])  # public, like the Hub's
    assert seed not in json.dumps(ours.manifest) and seed not in str(ours.path)
    monkeypatch.setenv("AUTOLAB_SYNTHETIC_SEED", seed)  # a lab's seed, handed to a job that prepares its own
    again = bench.prepare.prepare("synthetic")
    assert np.array_equal(ours.tokens("val"), again.tokens("val"))


def test_a_prepare_killed_halfway_is_rebuilt_not_used(bench, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    killed = subprocess.run([sys.executable, str(BENCH / "prepare.py"), "--source", "synthetic"],
                            env=env_for(cache, AUTOLAB_PREPARE_FAULT="val.bin"), capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -9, killed.stderr
    assert published(cache) == [] and list((cache / "data").glob(".tmp-*"))

    monkeypatch.setenv("AUTOLAB_CACHE", str(cache))
    data = bench.prepare.prepare("synthetic")
    assert published(cache) == [data.path] and not list((cache / "data").glob(".tmp-*"))

    (data.path / "manifest.json").unlink()  # a directory without its manifest is half-written
    with pytest.raises(bench.prepare.CacheError, match=re.escape(str(data.path))):
        bench.prepare.load_prepared(data.path)
    rebuilt = bench.prepare.prepare("synthetic")
    assert (rebuilt.path / "manifest.json").is_file()


def test_a_corrupt_cache_is_detected_and_rebuilt(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOLAB_CACHE", str(tmp_path / "cache"))
    data = bench.prepare.prepare("synthetic")
    val = data.path / "val.bin"
    good = val.read_bytes()
    val.write_bytes(bytes([good[0] ^ 1]) + good[1:])  # same size, different content
    with pytest.raises(bench.prepare.CacheError, match=re.escape(str(val))):
        bench.prepare.load_prepared(data.path, verify="full")
    assert bench.prepare.prepare("synthetic", verify="full").file("val.bin").read_bytes() == good
    (data.path / "train.bin").write_bytes(b"short")
    with pytest.raises(bench.prepare.CacheError, match="train.bin"):
        bench.prepare.load_prepared(data.path)
    assert bench.prepare.prepare("synthetic").sha256("train.bin") == data.sha256("train.bin")


# --- candidates that fail, cheat or lie -------------------------------------------------------


def test_a_crashing_candidate_fails_with_exit_code_3(bench, tmp_path):
    candidate = write_candidate(tmp_path, 'import prepare\nraise RuntimeError("boom in the candidate")\n')
    cli = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), "--candidate", str(candidate), "--result", str(tmp_path / "r.json"),
         "--source", "synthetic", "--termination-log", str(tmp_path / "term")],
        env=env_for(bench.cache), capture_output=True, text=True, timeout=120,
    )
    assert cli.returncode == bench.run.EXIT_CANDIDATE_FAILED == 3, cli.stdout + cli.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["status"] == "failed" and result["exit_code"] == 1 and "metrics" not in result
    assert "boom in the candidate" in result["reason"]
    assert json.loads((tmp_path / "term").read_text()) == result


def test_a_candidate_past_its_deadline_is_killed_with_its_children(bench, tmp_path):
    tag = f"{os.getpid()}.{time.time_ns() % 10**6}"  # a sleep of this many seconds is the grandchild
    candidate = write_candidate(tmp_path, (
        "import subprocess, time\n"
        f"subprocess.Popen(['sleep', '{tag}'], start_new_session=True)\n"
        "time.sleep(600)\n"
    ))
    result = harness(bench, candidate, tmp_path, budget=1, startup_allowance=2)
    assert result["status"] == "failed" and result["reason_code"] == "BudgetExceeded"
    assert "start-up allowance" in result["reason"]
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and alive(int(p.name))
                and f"sleep\0{tag}".encode() in (p / "cmdline").read_bytes()]


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for a parent that may never reap it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def test_a_diverging_candidate_fails(bench, tmp_path):
    source = TRAIN.read_text()
    assert "loss = model(x, y)\n" in source
    candidate = write_candidate(tmp_path, source.replace("loss = model(x, y)\n", "loss = model(x, y) * float('nan')\n"))
    result = harness(bench, candidate, tmp_path)
    assert result["status"] == "failed" and "nan" in result["reason"] and result["exit_code"] == 1


def test_a_printed_summary_never_becomes_the_metric(bench, tmp_path):
    fake = "\n---\nval_bpb:          0.000001\n"
    # It ends with os._exit(0): a normal interpreter exit with the loader's stream still open
    # can abort in torch's teardown (exit code 134) now and then, which is a crash, not the
    # missing export under test.
    no_export = write_candidate(tmp_path, "import os, sys, prepare\n"
                                          "next(prepare.make_loader('train', 1, 8))\n"
                                          f"print({fake!r})\nsys.stdout.flush()\nos._exit(0)\n",
                                "no_export.py")
    result = harness(bench, no_export, tmp_path)
    assert result["status"] == "failed" and result["reason_code"] == "NoExport" and "export" in result["reason"]

    source = TRAIN.read_text()
    assert "import prepare\n" in source
    forger = source.replace("import prepare\n", (
        "import prepare\n"
        "prepare.evaluate_bpb = lambda *args, **kwargs: 0.000001  # only this process sees it\n"
    ), 1) + f"print({fake!r})\n"
    result = harness(bench, write_candidate(tmp_path, forger), tmp_path)
    assert "val_bpb:          0.000001" in (tmp_path / "run.log").read_text()
    assert result["status"] == "succeeded", result["reason"]
    assert result["metrics"]["val_bpb"] > 0.1


def test_an_exported_model_that_peeks_at_the_next_token_fails(bench, tmp_path):
    candidate = write_candidate(tmp_path, (
        "import torch, prepare\n"
        "class Peek(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.scale = torch.nn.Parameter(torch.tensor(30.0))\n"
        "    def forward(self, idx):\n"
        "        nxt = torch.roll(idx, -1, dims=1)  # the target, read from the input\n"
        "        return self.scale * torch.nn.functional.one_hot(nxt, prepare.VOCAB_SIZE).float()\n"
        "next(prepare.make_loader('train', 1, 8))\n"
        "prepare.export_model(Peek(), {'num_steps': 0})\n"
    ))
    result = harness(bench, candidate, tmp_path)
    assert result["status"] == "failed" and result["reason_code"] == "NotCausal"
    assert "not causal" in result["reason"]


def test_a_model_that_peeks_at_one_position_only_fails(bench, tmp_path):
    """The tiny profile scores fewer rows than positions; the cuts must still reach every one."""
    candidate = write_candidate(tmp_path, (
        "import torch, prepare\n"
        "class Peek(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.scale = torch.nn.Parameter(torch.tensor(30.0))\n"
        "        mask = torch.zeros(prepare.MAX_SEQ_LEN)\n"
        "        mask[prepare.MAX_SEQ_LEN * 2 // 3] = 1.0  # one position of every row\n"
        "        self.register_buffer('mask', mask, persistent=False)\n"
        "    def forward(self, idx):\n"
        "        nxt = torch.roll(idx, -1, dims=1)\n"
        "        return self.scale * torch.nn.functional.one_hot(nxt, prepare.VOCAB_SIZE).float() * self.mask[None, :, None]\n"
        "next(prepare.make_loader('train', 1, 8))\n"
        "prepare.export_model(Peek(), {'num_steps': 0})\n"
    ))
    result = harness(bench, candidate, tmp_path)
    assert result["status"] == "failed" and result["reason_code"] == "NotCausal", result["reason"]


UNIFORM = (
    "import sys, time, torch, prepare\n"
    "class Flat(torch.nn.Module):  # the same logits everywhere: val_bpb = ln(V) per token\n"
    "    def __init__(self, bias):\n"
    "        super().__init__()\n"
    "        self.bias = torch.nn.Parameter(bias)\n"
    "    def forward(self, idx):\n"
    "        return self.bias.expand(idx.shape[0], idx.shape[1], prepare.VOCAB_SIZE)\n"
)


def test_the_first_export_after_training_is_the_one_measured(bench, tmp_path):
    candidate = write_candidate(tmp_path, UNIFORM + (
        "loader = prepare.make_loader('train', 8, 64)\n"
        "buffered = [next(loader) for _ in range(20)]\n"
        "prepare.export_model(Flat(torch.zeros(prepare.VOCAB_SIZE)), {})  # 'done': the clock stops\n"
        "counts = torch.ones(prepare.VOCAB_SIZE)\n"
        "for x, y in buffered:  # 'training' after done, on batches read ahead\n"
        "    counts += torch.bincount(y.flatten(), minlength=prepare.VOCAB_SIZE)\n"
        "time.sleep(1.5)\n"
        "prepare.export_model(Flat(counts.log()), {})\n"
        "print('EXPORTED-TWICE', flush=True)\n"
    ))
    result = harness(bench, candidate, tmp_path)
    assert result["status"] == "succeeded", result["reason"]
    data = bench.prepare.prepare("synthetic")
    import torch
    flat = bench.prepare.evaluate_bpb(lambda idx: torch.zeros(idx.shape[0], idx.shape[1], bench.prepare.VOCAB_SIZE),
                                      tokens=data.tokens("val"), token_bytes=data.token_bytes())
    assert result["metrics"]["val_bpb"] == pytest.approx(flat, rel=1e-6)  # the untrained first export
    log = (tmp_path / "run.log").read_text()
    assert "EXPORTED-TWICE" not in log and "the candidate was stopped there" in log


def test_a_candidate_cannot_write_a_file_past_its_size_limit(bench, tmp_path):
    candidate = write_candidate(tmp_path, (
        "import signal\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "try:\n"
        "    with open('big', 'wb') as f:\n"
        "        for _ in range(300):\n"
        "            f.write(bytes(2**20))\n"
        "    print('WROTE-300-MIB', flush=True)\n"
        "except OSError as e:\n"
        "    print('REFUSED', e.errno, flush=True)\n"
    ))
    harness(bench, candidate, tmp_path)
    log = (tmp_path / "run.log").read_text()
    assert "REFUSED 27" in log and "WROTE-300-MIB" not in log  # EFBIG at the tiny profile's 256 MiB


def test_a_candidate_that_edits_the_harness_is_void(bench, tmp_path):
    copy = tmp_path / "bench"
    shutil.copytree(BENCH, copy, ignore=shutil.ignore_patterns("__pycache__"))
    candidate = write_candidate(tmp_path, (
        "import os, prepare\n"
        "open(prepare.__file__, 'a').write('\\n# tampered\\n')\n"
    ))
    cli = subprocess.run(
        [sys.executable, str(copy / "run.py"), "--candidate", str(candidate), "--result", str(tmp_path / "r.json"),
         "--source", "synthetic"], env=env_for(bench.cache), capture_output=True, text=True, timeout=120,
    )
    result = json.loads((tmp_path / "r.json").read_text())
    assert cli.returncode == 3 and result["status"] == "failed" and "prepare.py" in result["reason"]


def test_a_candidate_can_neither_read_nor_edit_the_validation_data(bench, tmp_path):
    data = bench.prepare.prepare("synthetic", verify="full")
    val = data.file("val.bin")
    before = hashlib.sha256(val.read_bytes()).hexdigest()
    candidate = write_candidate(tmp_path, (
        "import os, prepare\n"
        f"val = {str(val)!r}\n"
        "for what, how in (('READ', 'rb'), ('WROTE', 'r+b')):\n"
        "    try:\n"
        "        open(val, how).close(); print(what, flush=True)\n"
        "    except OSError as e:\n"
        "        print('refused', what, e.errno, flush=True)\n"
        "import hashlib, numpy\n"
        "try:\n"
        "    got = numpy.asarray(prepare.active_data().tokens('val')).tobytes()\n"
        "    print('ACTIVE', hashlib.sha256(got).hexdigest(), flush=True)\n"
        "except Exception as e:\n"
        "    print('refused ACTIVE', type(e).__name__, flush=True)\n"
    ))
    result = harness(bench, candidate, tmp_path)
    log = (tmp_path / "run.log").read_text()
    assert "refused READ" in log and "refused WROTE" in log, log
    assert "\nREAD" not in log and "WROTE\n" not in log.replace("refused WROTE", "")
    # prepare.active_data() in the sandbox finds no prepared data, so it may try to make a synthetic
    # split of its own (whether that gets far depends on what the sandbox's uid may write). The
    # validation half comes from the lab's secret seed, which the sandbox cannot read: whatever it
    # makes is another draw, never the lab's validation tokens.
    ours = hashlib.sha256(np.asarray(data.tokens("val")).tobytes()).hexdigest()
    assert f"ACTIVE {ours}" not in log, log
    assert "refused ACTIVE" in log or "ACTIVE " in log, log
    assert result["status"] == "failed"
    assert hashlib.sha256(val.read_bytes()).hexdigest() == before


# --- the Hub source, against a local stand-in --------------------------------------------------


class FakeHub(http.server.ThreadingHTTPServer):
    """Serves /datasets/<repo>/resolve/<revision>/<file> with the headers huggingface_hub reads."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[tuple[str, str]] = []
        super().__init__(("127.0.0.1", 0), FakeHubHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _respond(self, send_body: bool) -> None:
        self.server.requests.append((self.command, self.path))
        m = re.fullmatch(r"/datasets/karpathy/climbmix-400b-shuffle/resolve/([^/]+)/([^/?]+)", self.path)
        body = self.server.files.get(m.group(2)) if m else None
        if body is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", FakeHub.COMMIT)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start = 0
        rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if rng and send_body:
            start = int(rng.group(1))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body) - start))
        self.send_header("ETag", f'"{hashlib.sha256(body).hexdigest()}"')
        self.send_header("X-Repo-Commit", FakeHub.COMMIT)
        self.end_headers()
        if send_body:
            self.wfile.write(body[start:])

    def do_HEAD(self) -> None:
        self._respond(send_body=False)

    def do_GET(self) -> None:
        self._respond(send_body=True)


def test_hub_source_downloads_through_huggingface_hub(bench, tmp_path, monkeypatch):
    shards = tmp_path / "shards"
    write_parquet_shards(shards, names=("shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"),
                         docs_per_shard=200)
    hub = FakeHub({p.name: p.read_bytes() for p in shards.iterdir()})
    monkeypatch.setenv("AUTOLAB_CACHE", str(tmp_path / "cache"))
    try:
        data = bench.prepare.prepare("hub", num_shards=2, endpoint=hub.url)
    finally:
        hub.shutdown()
    fetched = {path.rsplit("/", 1)[-1] for method, path in hub.requests if method == "GET"}
    assert fetched == {"shard_00000.parquet", "shard_00001.parquet", "shard_06542.parquet"}
    downloads = tmp_path / "cache" / "downloads" / "karpathy--climbmix-400b-shuffle"
    assert (downloads / "shard_06542.parquet").read_bytes() == (shards / "shard_06542.parquet").read_bytes()
    assert data.manifest["splits"]["val"]["documents"] == 200
    assert data.manifest["splits"]["train"]["documents"] == 400
    # prepared once: no network needed again (the server is gone)
    assert bench.prepare.prepare("hub", num_shards=2, endpoint=hub.url).path == data.path


def test_hub_source_names_a_missing_shard(bench, tmp_path, monkeypatch):
    hub = FakeHub({})
    monkeypatch.setenv("AUTOLAB_CACHE", str(tmp_path / "cache"))
    try:
        with pytest.raises(bench.prepare.PrepareError, match="shard_00000.parquet") as err:
            bench.prepare.prepare("hub", num_shards=1, endpoint=hub.url)
    finally:
        hub.shutdown()
    assert hub.url in str(err.value)
    assert published(tmp_path / "cache") == [] and not list((tmp_path / "cache" / "data").glob(".tmp-*"))


# --- bad input --------------------------------------------------------------------------------


def test_an_empty_or_missing_source_directory_is_named(bench, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(bench.prepare.PrepareError, match=f"{re.escape(str(empty))} has no parquet shards"):
        bench.prepare.prepare(f"dir:{empty}")
    missing = tmp_path / "missing"
    cli = subprocess.run([sys.executable, str(BENCH / "prepare.py"), "--source", f"dir:{missing}"],
                         env=env_for(tmp_path / "cache"), capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and f"{missing} does not exist" in cli.stderr


def test_a_corrupt_parquet_shard_is_named_and_leaves_nothing_behind(bench, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    write_parquet_shards(corpus, names=("shard_00000.parquet", "shard_06542.parquet"), docs_per_shard=50)
    bad = corpus / "shard_00001.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    monkeypatch.setenv("AUTOLAB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(bench.prepare.PrepareError, match=re.escape(str(bad))):
        bench.prepare.prepare(f"dir:{corpus}")
    assert published(tmp_path / "cache") == [] and not list((tmp_path / "cache" / "data").glob(".tmp-*"))

    result = harness(bench, TRAIN, tmp_path, source=f"dir:{corpus}")
    assert result["status"] == "error" and str(bad) in result["reason"]
    assert bench.run.EXIT_CODES[result["status"]] == bench.run.EXIT_HARNESS_ERROR == 4


def test_a_text_shard_without_a_text_column_is_named(bench, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    corpus = tmp_path / "corpus"
    write_parquet_shards(corpus, names=("shard_06542.parquet",), docs_per_shard=20)
    pq.write_table(pa.table({"body": ["no text column"]}), corpus / "shard_00000.parquet")
    with pytest.raises(bench.prepare.PrepareError, match=r"shard_00000\.parquet has no 'text' column"):
        bench.prepare.prepare(f"dir:{corpus}")


def test_a_zombie_left_by_the_candidate_has_exited_and_is_not_a_survivor(bench):
    """After the candidate, the harness kills what is left in its PID namespace and voids the run
    if anything still lives (ProcessesLeft). A zombie has exited: it holds no memory and runs no
    code, so waiting for its parent to reap it must not void an honest run; a live process is
    still a survivor."""
    import signal
    import time

    zombie = os.fork()
    if zombie == 0:
        os._exit(0)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for _ in range(200):  # the child has exited once /proc says Z
            if Path(f"/proc/{zombie}/stat").read_text().split(") ")[1].startswith("Z"):
                break
            time.sleep(0.01)
        assert bench.harness.candidate._living([zombie, alive.pid, 2**22 + 1]) == [alive.pid]
    finally:
        alive.send_signal(signal.SIGKILL)
        alive.wait()
        os.waitpid(zombie, 0)
