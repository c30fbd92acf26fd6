# The module train.py imports; the parts of data preparation are its prepare_*.py siblings (a
# comment, not the docstring: `prepare.py --help` prints the docstring's first line).
"""The fixed harness of the benchmark: data, tokenizer, loader, metric, export.

Every experiment changes `train.py` and nothing else; this file is what makes
two runs comparable, so experiments never change it. It owns:

* the constants of the active profile (`MAX_SEQ_LEN`, `TIME_BUDGET`,
  `EVAL_TOKENS`, `VOCAB_SIZE`, ...), chosen by the environment variable
  `AUTOLAB_BENCH_PROFILE`: `default` (one CUDA GPU, a ~50M-parameter model,
  300 s of training) or `tiny` (a CPU, a toy model, a few seconds; for tests
  and demos). `train.py` imports them from here.
* data preparation (`python prepare.py --source SRC`, or `prepare(source)`):
  text from the Hugging Face Hub (`hub`: shards of
  karpathy/climbmix-400b-shuffle, validation pinned to shard_06542), from a
  local directory (`dir:PATH`: parquet shards in the same layout, or text
  files) or generated (`synthetic`); a byte-level BPE tokenizer trained on the
  training split; both splits tokenised once into uint16 token streams
  (`train.bin`, `val.bin`: a BOS token, then the document, for every document,
  concatenated) that training reads through `np.memmap`.
* the cache: `$AUTOLAB_CACHE` (default `~/.cache/autolab`) holds one directory
  per (profile, source fingerprint) under `data/`. A build happens in a
  temporary directory and is published by one atomic rename, with
  `manifest.json` (sizes and sha256 of every file) written last. A directory
  without a valid manifest, or whose files disagree with it, is never used: it
  is rebuilt. Downloads live in `downloads/` and survive rebuilds.
* the loader (`make_loader`): sequential windows over a token stream, pinned
  memory and a background thread so the GPU never waits for data.
* the metric (`evaluate_bpb`): validation bits per byte over the first
  `EVAL_TOKENS` tokens of the pinned validation split, computed here from the
  model's logits, never from a loss the model reports.
* the export hook (`export_model`): `train.py` hands over its trained model;
  this writes it as a `torch.export` program that the run harness evaluates
  in a separate process (see README.md, "Anti-forgery").
* the step curve (`report_step`): appends JSON lines to `$AUTOLAB_CURVE_PATH`.

Environment: `AUTOLAB_BENCH_PROFILE`, `AUTOLAB_CACHE`, `AUTOLAB_SOURCE` (the
source `train.py` uses when run by hand), `AUTOLAB_DATA_DIR` (an exact
prepared directory; set by the run harness), `AUTOLAB_TIME_BUDGET` (overrides
`TIME_BUDGET`), `AUTOLAB_EXPORT_DIR`, `AUTOLAB_CURVE_PATH`, `HF_ENDPOINT`.
`AUTOLAB_PREPARE_FAULT=<step>` kills the preparing process at that step
(`download`, `tokenizer`, `train.bin`, `val.bin`, `manifest`); tests use it to
prove that a half-built cache is never used.

This file is the module train.py imports and the one a reader opens: the profiles, the
constants and the entry point, with every name of the parts below importable from here. Each
part is a sibling module of one concern, pinned with this file (bench/HARNESS lists them):

    prepare.py            the profiles, the constants, the errors, `python prepare.py --source SRC`
    prepare_sources.py    where documents come from: hub, dir:PATH, synthetic
    prepare_tokenizer.py  the tokenizer and the tokenisation workers
    prepare_cache.py      the cache: build, publish, verify; `prepare()`, `active_data()`
    prepare_loader.py     the loader and the harness's training stream
    prepare_metric.py     `evaluate_bpb`
    prepare_export.py     `report_step` and `export_model`

The siblings import the constants from here, so this file defines them before it imports the
siblings. The controller reads `PROFILES` from this file's text without running it
(controller/lab/profiles.py): the profiles stay here, as literals.

torch is imported lazily, so data preparation and the run harness start fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # `python prepare.py`: run the module its siblings import (as `prepare`), never
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # a second copy of it as __main__
    import prepare

    sys.exit(prepare.main())

# ---------------------------------------------------------------------------
# Profiles and the constants train.py imports


@dataclasses.dataclass(frozen=True)
class Profile:
    name: str
    max_seq_len: int  # context length of training and evaluation
    time_budget: float  # seconds of training (start-up and compilation excluded)
    eval_tokens: int  # validation tokens scored by evaluate_bpb
    eval_batch_size: int  # rows per evaluation batch; the exported program's batch
    vocab_size: int  # BPE vocabulary, special tokens included
    num_shards: int  # hub source: training shards to download
    tokenizer_train_chars: int  # characters of training text the tokenizer learns from
    synthetic_docs: int  # synthetic source: training documents generated
    startup_allowance: float  # run harness: seconds from start to the first training batch (compilation)
    export_allowance: float  # run harness: seconds from "training done" to the candidate's exit (export)
    eval_timeout: float  # run harness: seconds allowed for the evaluation


PROFILES = {
    "default": Profile(
        name="default",
        max_seq_len=2048,
        time_budget=300.0,
        eval_tokens=20 * 2**19,  # 10,485,760 tokens, ~40 MB of text
        eval_batch_size=32,
        vocab_size=8192,
        num_shards=8,
        tokenizer_train_chars=200_000_000,
        synthetic_docs=100_000,
        startup_allowance=180.0,
        export_allowance=30.0,  # export measured at 3.5-4.9 s on an H200; a bound on work after `done`
        eval_timeout=600.0,
    ),
    "tiny": Profile(
        name="tiny",
        # 128, not 256: the causality probe cuts every position once, T perturbed rows of T
        # tokens, so its cost goes as T^2; at 256 it was 4/5 of a tiny evaluation's scoring.
        max_seq_len=128,
        time_budget=4.0,
        eval_tokens=16 * 2**10,  # 16,384 tokens
        eval_batch_size=8,
        vocab_size=1024,
        num_shards=1,
        tokenizer_train_chars=2_000_000,
        synthetic_docs=4_000,
        startup_allowance=60.0,
        export_allowance=10.0,  # export measured at 1.3-1.7 s on 2 CPU cores
        eval_timeout=120.0,
    ),
}

PROFILE = os.environ.get("AUTOLAB_BENCH_PROFILE", "default")
if PROFILE not in PROFILES:
    raise SystemExit(f"AUTOLAB_BENCH_PROFILE={PROFILE!r} is not a profile; use one of {sorted(PROFILES)}")
_ACTIVE = PROFILES[PROFILE]

MAX_SEQ_LEN = _ACTIVE.max_seq_len
TIME_BUDGET = float(os.environ.get("AUTOLAB_TIME_BUDGET") or _ACTIVE.time_budget)
# The harness's seed (run.py --seed): 0 for a measured run, 1, 2, ... for the lab's noise runs,
# 1001, 1002, ... for its confirm runs. train.py adds it to its own SEED.
HARNESS_SEED = int(os.environ.get("AUTOLAB_SEED") or 0)
EVAL_TOKENS = _ACTIVE.eval_tokens
EVAL_BATCH_SIZE = _ACTIVE.eval_batch_size
VOCAB_SIZE = _ACTIVE.vocab_size
if not (math.isfinite(TIME_BUDGET) and TIME_BUDGET > 0):
    raise SystemExit(f"AUTOLAB_TIME_BUDGET must be a positive number of seconds, not {TIME_BUDGET}")

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|reserved|>"]  # ids 0..3, 0 bytes each
BOS_TOKEN = "<|bos|>"
BOS_ID = 0

# GPT-4 style pre-tokenisation split (numbers in groups of at most two digits),
# then byte-level mapping: every byte sequence is representable, nothing is <unk>.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

HUB_REPO = "karpathy/climbmix-400b-shuffle"
HUB_REVISION = "main"
VAL_SHARD = "shard_06542.parquet"  # the pinned validation shard
TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".jsonl")
VAL_FRACTION = 0.1  # text directories: share of documents held out for validation
TOKENIZER_DOC_CHARS = 10_000  # longer documents are cut when training the tokenizer
CURVE_EVERY_STEPS = 10  # report_step writes at most one line per this many steps
CACHE_FORMAT = 1  # bump when the cache layout or the tokenisation changes


class PrepareError(Exception):
    """Data or cache problem; the message names the path and says what to do."""


class CacheError(PrepareError):
    """A prepared directory is missing, half-written or does not match its manifest."""


def _log(message: str) -> None:
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    return Path(os.environ.get("AUTOLAB_CACHE") or Path.home() / ".cache" / "autolab").expanduser()


# Compiled kernels go next to the data so a second run starts warm.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "compile"))


def _profile(profile: str | Profile | None) -> Profile:
    if isinstance(profile, Profile):
        return profile
    name = profile or PROFILE
    if name not in PROFILES:
        raise PrepareError(f"unknown profile {name!r}; use one of {sorted(PROFILES)}")
    return PROFILES[name]


def _fault(step: str) -> None:
    if os.environ.get("AUTOLAB_PREPARE_FAULT") == step:
        _log(f"AUTOLAB_PREPARE_FAULT={step}: killing this process mid-build")
        os.kill(os.getpid(), signal.SIGKILL)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()



# ---------------------------------------------------------------------------
# The parts, each in its sibling module; their names are importable from here (train.py, the
# harness and the controller use `prepare.X`). They import the constants above, so they come after.

from prepare_sources import (Source, check_parquet, _parquet_tasks, _parquet_docs, _workers,
                             HubSource, DirSource, _docs_tasks, _PEOPLE, _COLOURS, _CITIES, _PETS,
                             _NOUNS, _ADJS, _VERBS, _NUMBER_WORDS, _synthetic_document,
                             SYNTHETIC_SEED_ENV, SYNTHETIC_SEED_FILE, synthetic_seed,
                             SyntheticSource, make_source)  # noqa: E402,F401
from prepare_tokenizer import (_new_tokenizer, train_tokenizer, token_byte_lengths, _worker_init,
                               _encode_docs, _tokenize_task, _tokenize_split)  # noqa: E402,F401
from prepare_cache import (PreparedData, _data_dir, load_prepared, _locked, _fsync_dir, _build,
                           prepare, _remember_source, active_data)  # noqa: E402,F401
from prepare_loader import (DATA_FD_ENV, STREAM_READ, STREAM_DONE, STREAM_REQUEST,
                            STREAM_MAX_TOKENS, _stream_socket, _read_stream, training_done,
                            make_loader)  # noqa: E402,F401
from prepare_metric import _model_device, evaluate_bpb  # noqa: E402,F401
from prepare_export import export_model, export_program, report_step  # noqa: E402,F401

# What a harness copies for the candidate to `import prepare` (uid mode: harness_uid): this file and
# its siblings, each also listed in bench/HARNESS.
FILES = ("prepare.py", "prepare_sources.py", "prepare_tokenizer.py", "prepare_cache.py", "prepare_loader.py",
         "prepare_metric.py", "prepare_export.py")


# ---------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=os.environ.get("AUTOLAB_SOURCE", "hub"),
                        help="hub (default), synthetic, or dir:PATH")
    parser.add_argument("--profile", default=None, help=f"default: $AUTOLAB_BENCH_PROFILE or default ({PROFILE})")
    parser.add_argument("--num-shards", type=int, default=None, help="hub: training shards (profile default)")
    parser.add_argument("--endpoint", default=None, help="hub: Hub endpoint (default $HF_ENDPOINT or huggingface.co)")
    parser.add_argument("--verify", choices=["size", "full"], default="full",
                        help="how to check an existing cache: sizes, or sizes and sha256 (default)")
    args = parser.parse_args(argv)
    try:
        prepared = prepare(args.source, profile=args.profile, num_shards=args.num_shards,
                           endpoint=args.endpoint, verify=args.verify)
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    splits = prepared.manifest["splits"]
    print(prepared.path)
    print(f"train tokens: {splits['train']['tokens']:,}  val tokens: {splits['val']['tokens']:,}  "
          f"profile: {prepared.profile}  source: {prepared.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
