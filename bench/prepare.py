# Kept as one file: the one harness module train.py imports, read top to bottom (nanochat-style),
# and a file every lab pins. (A comment, not the docstring: `prepare.py --help` prints its first line.)
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

torch is imported lazily, so data preparation and the run harness start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import queue
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

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
# Sources: where documents come from
#
# A source yields tokenisation tasks per split; a task is either
# ("parquet", path, row_group, part, parts) or ("docs", [text, ...]). Workers
# turn tasks into token arrays, so large parquet shards are read and tokenised
# in parallel without passing text between processes.


class Source(Protocol):
    spec: str  # the --source string, normalised
    kind: str  # hub | dir | synthetic

    def identity(self) -> dict[str, Any]: ...  # what the cache fingerprint covers

    def fetch(self, log: Callable[[str], None]) -> None: ...  # downloads and checks, if any

    def docs(self, split: str) -> Iterator[str]: ...  # document texts, in order

    def tasks(self, split: str) -> Iterator[tuple]: ...  # the same documents, as tokenisation tasks

    def describe(self) -> dict[str, Any]: ...  # inputs and split rule, for the manifest


def check_parquet(path: Path) -> int:
    """Row groups of a readable parquet shard with a text column; PrepareError naming it otherwise."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        groups = pf.metadata.num_row_groups
        names = pf.schema_arrow.names
    except Exception as e:
        raise PrepareError(
            f"cannot read parquet shard {path}: {e}; delete or replace the file and run prepare again"
        ) from e
    if "text" not in names:
        raise PrepareError(f"parquet shard {path} has no 'text' column (columns: {names}); fix or remove it")
    return groups


def _parquet_tasks(path: Path, want_tasks: int) -> Iterator[tuple]:
    groups = check_parquet(path)
    parts = max(1, -(-want_tasks // max(groups, 1)))
    for rg in range(groups):
        for part in range(parts):
            yield ("parquet", str(path), rg, part, parts)


def _parquet_docs(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=1024, columns=["text"]):
            for text in batch.column(0).to_pylist():
                if text:
                    yield text
    except PrepareError:
        raise
    except Exception as e:
        raise PrepareError(
            f"cannot read parquet shard {path}: {e}; delete or replace the file and run prepare again"
        ) from e


def _workers() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class HubSource:
    """Shards of karpathy/climbmix-400b-shuffle, downloaded with huggingface_hub."""

    kind = "hub"

    def __init__(self, num_shards: int, endpoint: str | None) -> None:
        if num_shards < 1:
            raise PrepareError(f"--num-shards must be at least 1, not {num_shards}")
        self.spec = "hub"
        self.endpoint = endpoint
        self.train_shards = [f"shard_{i:05d}.parquet" for i in range(num_shards)]
        self.dir = cache_root() / "downloads" / HUB_REPO.replace("/", "--")

    def identity(self) -> dict[str, Any]:
        return {"repo": HUB_REPO, "revision": HUB_REVISION, "train": self.train_shards, "val": VAL_SHARD}

    def fetch(self, log: Callable[[str], None]) -> None:
        try:
            from huggingface_hub import hf_hub_download  # only the hub source needs it
        except ImportError as e:
            raise PrepareError("the hub source needs huggingface_hub (pip install huggingface_hub)") from e
        endpoint = self.endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
        self.dir.mkdir(parents=True, exist_ok=True)
        for name in [*self.train_shards, VAL_SHARD]:
            if (self.dir / name).is_file():  # hf_hub_download publishes a file only when complete
                continue
            log(f"downloading {HUB_REPO}/{name} from {endpoint}")
            try:
                hf_hub_download(
                    repo_id=HUB_REPO,
                    filename=name,
                    repo_type="dataset",
                    revision=HUB_REVISION,
                    local_dir=self.dir,
                    endpoint=self.endpoint,
                )
            except Exception as e:
                raise PrepareError(
                    f"downloading {name} of dataset {HUB_REPO} from {endpoint} into {self.dir} failed: {e}; "
                    "check the network or HF_ENDPOINT, or use --source dir:PATH with local shards"
                ) from e
        for name in [*self.train_shards, VAL_SHARD]:
            check_parquet(self.dir / name)
        _fault("download")

    def tasks(self, split: str) -> Iterator[tuple]:
        shards = self.train_shards if split == "train" else [VAL_SHARD]
        per_shard = max(1, 4 * _workers() // len(shards))
        for name in shards:
            yield from _parquet_tasks(self.dir / name, per_shard)

    def docs(self, split: str) -> Iterator[str]:
        for name in self.train_shards if split == "train" else [VAL_SHARD]:
            yield from _parquet_docs(self.dir / name)

    def describe(self) -> dict[str, Any]:
        return {
            "inputs": {n: (self.dir / n).stat().st_size for n in [*self.train_shards, VAL_SHARD]},
            "split": f"validation is {VAL_SHARD}; training is shards 0..{len(self.train_shards) - 1}",
        }


class DirSource:
    """A local directory: parquet shards (hub layout) or text files."""

    kind = "dir"

    def __init__(self, path: str) -> None:
        if not path:
            raise PrepareError("--source dir: needs a path, e.g. dir:/data/texts")
        self.path = Path(path).expanduser().resolve()
        self.spec = f"dir:{self.path}"
        if not self.path.exists():
            raise PrepareError(f"source directory {self.path} does not exist; create it or fix the path")
        if not self.path.is_dir():
            raise PrepareError(f"source {self.path} is not a directory; pass dir:PATH of a directory")
        self.parquet = sorted(p for p in self.path.glob("*.parquet") if p.is_file())
        self.texts: list[Path] = []
        if not self.parquet:
            for root, dirs, files in os.walk(self.path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for f in sorted(files):
                    if f.endswith(TEXT_SUFFIXES) and not f.startswith("."):
                        self.texts.append(Path(root) / f)
        if not self.parquet and not self.texts:
            raise PrepareError(
                f"source directory {self.path} has no parquet shards and no text files "
                f"({' '.join(TEXT_SUFFIXES)}); put data there or use --source synthetic"
            )
        if self.parquet:
            val = self.path / VAL_SHARD
            if val not in self.parquet:
                raise PrepareError(
                    f"source directory {self.path} has parquet shards but no validation shard {VAL_SHARD}; "
                    f"name the shard to hold out {VAL_SHARD} (as on the hub)"
                )
            if len(self.parquet) < 2:
                raise PrepareError(f"source directory {self.path} has only the validation shard; add training shards")
        self._val_keys: set[str] | None = None

    def _stat(self, p: Path) -> list:
        st = p.stat()
        return [str(p.relative_to(self.path)), st.st_size, st.st_mtime_ns]

    def identity(self) -> dict[str, Any]:
        files = self.parquet or self.texts
        return {"path": str(self.path), "files": [self._stat(p) for p in files]}

    def fetch(self, log: Callable[[str], None]) -> None:
        for p in self.parquet:
            check_parquet(p)
        if self.texts:
            self._val_keys = self._split()

    # Text documents: a file is one document, except .jsonl where each line's
    # "text" is one. A document is held out for validation when the hash of
    # its key (relative path, plus ":line" for jsonl) falls below VAL_FRACTION;
    # if that leaves validation empty, the document with the smallest hash goes.
    def _read(self, p: Path) -> str:
        try:
            return p.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise PrepareError(f"cannot read {p}: {e}; fix its permissions or remove it") from e

    def _text_docs(self) -> Iterator[tuple[str, str]]:
        for p in self.texts:
            rel = str(p.relative_to(self.path))
            if p.suffix != ".jsonl":
                text = self._read(p)
                if text.strip():
                    yield rel, text
                continue
            for lineno, line in enumerate(self._read(p).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError) as e:
                    raise PrepareError(
                        f"{p}:{lineno} is not a JSON object with a 'text' field ({e}); fix or remove the line"
                    ) from e
                if isinstance(text, str) and text.strip():
                    yield f"{rel}:{lineno}", text

    @staticmethod
    def _key_hash(key: str) -> float:
        return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") / 2**64

    def _split(self) -> set[str]:
        hashes = {key: self._key_hash(key) for key, _ in self._text_docs()}
        if len(hashes) < 2:
            raise PrepareError(
                f"source directory {self.path} holds {len(hashes)} non-empty document(s); "
                "at least 2 are needed (one is held out for validation)"
            )
        val = {k for k, h in hashes.items() if h < VAL_FRACTION}
        if not val:
            val = {min(hashes, key=hashes.get)}
        if len(val) == len(hashes):
            val.discard(max(hashes, key=hashes.get))
        return val

    def tasks(self, split: str) -> Iterator[tuple]:
        if self.parquet:
            shards = [p for p in self.parquet if (p.name == VAL_SHARD) == (split == "val")]
            per_shard = max(1, 4 * _workers() // len(shards))
            for p in shards:
                yield from _parquet_tasks(p, per_shard)
            return
        yield from _docs_tasks(self.docs(split))

    def docs(self, split: str) -> Iterator[str]:
        if self.parquet:
            for p in self.parquet:
                if (p.name == VAL_SHARD) == (split == "val"):
                    yield from _parquet_docs(p)
            return
        if self._val_keys is None:
            self._val_keys = self._split()
        for key, text in self._text_docs():
            if (key in self._val_keys) == (split == "val"):
                yield text

    def describe(self) -> dict[str, Any]:
        if self.parquet:
            return {
                "inputs": {p.name: p.stat().st_size for p in self.parquet},
                "split": f"validation is {VAL_SHARD}; training is the other shards",
            }
        return {
            "inputs": {str(p.relative_to(self.path)): p.stat().st_size for p in self.texts},
            "split": (
                f"a document (a file; a line of a .jsonl file, key path:line) is held out for validation when "
                f"sha1(key)[:8]/2**64 < {VAL_FRACTION}; if none is, the smallest hash is"
            ),
            "val_documents": sorted(self._val_keys or ()),
        }


def _docs_tasks(docs: Iterable[str], chars_per_task: int = 4_000_000) -> Iterator[tuple]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= chars_per_task:
            yield ("docs", batch)
            batch, size = [], 0
    if batch:
        yield ("docs", batch)


# Synthetic text: a small world with fixed facts (every person has one colour,
# one city, one pet), arithmetic, counting and templated stories, so even a
# tiny model can learn more than unigram statistics in seconds.
_PEOPLE = "Ada Ben Cleo Dmitri Esme Farid Greta Hugo Ines Jonas Kira Liam Mei Nils Olga Pablo".split()
_COLOURS = "red blue green amber violet silver orange teal".split()
_CITIES = "Lisbon Oslo Kyoto Lima Cairo Quito Perth Turin Accra Hanoi".split()
_PETS = "cat dog parrot tortoise rabbit goldfish hamster".split()
_NOUNS = "river garden lantern engine letter bridge window forest market violin harbour clock".split()
_ADJS = "quiet bright old narrow heavy gentle broken distant golden hollow".split()
_VERBS = "found painted carried repaired opened followed measured crossed".split()
_NUMBER_WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()


def _synthetic_document(rng: random.Random) -> str:
    lines = [f"# Notes {rng.randint(1, 999)}"]
    for _ in range(rng.randint(3, 9)):
        kind = rng.randrange(4)
        i = rng.randrange(len(_PEOPLE))
        who = _PEOPLE[i]
        if kind == 0:
            fact = rng.randrange(3)
            if fact == 0:
                lines.append(f"{who}'s favourite colour is {_COLOURS[(3 * i + 1) % len(_COLOURS)]}.")
            elif fact == 1:
                lines.append(f"{who} lives in {_CITIES[(7 * i + 2) % len(_CITIES)]}.")
            else:
                lines.append(f"{who} has a {_PETS[(5 * i + 3) % len(_PETS)]}.")
        elif kind == 1:
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            lines.append(f"{a} + {b} = {a + b}.")
        elif kind == 2:
            start = rng.randint(0, 6)
            lines.append("Counting: " + ", ".join(_NUMBER_WORDS[start : start + rng.randint(3, 6)]) + ".")
        else:
            lines.append(
                f"The {rng.choice(_ADJS)} {rng.choice(_NOUNS)} was {rng.choice(_VERBS)} by {who} "
                f"near the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}."
            )
    return "\n".join(lines) + "\n"


SYNTHETIC_SEED_ENV = "AUTOLAB_SYNTHETIC_SEED"
SYNTHETIC_SEED_FILE = "synthetic.seed"  # in the cache root, 0600: the validation split's secret


def synthetic_seed() -> str:
    """The secret the synthetic validation split is generated from: $AUTOLAB_SYNTHETIC_SEED, else
    the cache's own (made once, at random). Were it public, a candidate could regenerate the
    validation text inside its sandbox and memorise it; the sandbox shows it neither."""
    if os.environ.get(SYNTHETIC_SEED_ENV):
        return os.environ[SYNTHETIC_SEED_ENV]
    path = cache_root() / SYNTHETIC_SEED_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(16).hex() + "\n")
    return path.read_text().strip()


class SyntheticSource:
    """A generated corpus. Training documents come from a public seed; validation documents
    from a secret one (synthetic_seed), so the validation text cannot be regenerated by code
    that cannot read the cache."""

    kind = "synthetic"
    VERSION = 2

    def __init__(self, docs: int) -> None:
        self.spec = "synthetic"
        self.n_docs = {"train": docs, "val": max(200, docs // 10)}
        self.seed = synthetic_seed()

    def identity(self) -> dict[str, Any]:
        # The seed's digest, not the seed: the manifest and the cache's folder name are not secret.
        return {"version": self.VERSION, "docs": self.n_docs,
                "val_seed_sha256": hashlib.sha256(self.seed.encode()).hexdigest()[:16]}

    def fetch(self, log: Callable[[str], None]) -> None:
        pass

    def docs(self, split: str) -> Iterator[str]:
        rng = random.Random(f"autolab-synthetic-{split}" if split == "train" else f"autolab-synthetic-val-{self.seed}")
        for _ in range(self.n_docs[split]):
            yield _synthetic_document(rng)

    def tasks(self, split: str) -> Iterator[tuple]:
        yield from _docs_tasks(self.docs(split))

    def describe(self) -> dict[str, Any]:
        return {"inputs": {}, "split": "separately seeded generators: a public seed for training, "
                                       "the cache's secret seed for validation"}


def make_source(source: str, *, profile: str | Profile | None = None, num_shards: int | None = None,
                endpoint: str | None = None) -> HubSource | DirSource | SyntheticSource:
    prof = _profile(profile)
    if source == "hub":
        return HubSource(num_shards or prof.num_shards, endpoint)
    if source == "synthetic":
        return SyntheticSource(prof.synthetic_docs)
    if source.startswith("dir:"):
        return DirSource(source[4:])
    raise PrepareError(f"unknown source {source!r}; use hub, synthetic or dir:PATH")


# ---------------------------------------------------------------------------
# Tokenizer and tokenisation workers


def _new_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(docs: Iterable[str], vocab_size: int, max_chars: int):
    """Learn a byte-level BPE on at most max_chars characters of docs."""
    from tokenizers import pre_tokenizers, trainers

    def sample() -> Iterator[str]:
        seen = 0
        for doc in docs:
            doc = doc[:TOKENIZER_DOC_CHARS]
            yield doc
            seen += len(doc)
            if seen >= max_chars:
                return

    if vocab_size > 2**16:
        raise PrepareError(f"vocab_size {vocab_size} does not fit the uint16 token files")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sample(), trainer=trainer)
    if tok.token_to_id(BOS_TOKEN) != BOS_ID:
        raise PrepareError(f"tokenizer put {BOS_TOKEN} at id {tok.token_to_id(BOS_TOKEN)}, expected {BOS_ID}")
    return tok


def token_byte_lengths(tok, vocab_size: int) -> np.ndarray:
    """Bytes of text each token id stands for; special tokens (and unused ids) count 0."""
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    table = np.zeros(vocab_size, dtype=np.int32)
    for token, idx in tok.get_vocab().items():
        if token in SPECIAL_TOKENS:
            continue
        if not set(token) <= alphabet:
            raise PrepareError(f"token {token!r} is not byte-level; the tokenizer is misconfigured")
        table[idx] = len(token)  # byte-level: one character per byte
    return table


_worker_tok = None


def _worker_init(tokenizer_path: str) -> None:
    global _worker_tok
    from tokenizers import Tokenizer

    _worker_tok = Tokenizer.from_file(tokenizer_path)


def _encode_docs(tok, docs: list[str]) -> np.ndarray:
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = [e.ids for e in encode(docs, add_special_tokens=False)]
    lens = np.fromiter((len(x) + 1 for x in ids), dtype=np.int64, count=len(ids))
    out = np.empty(int(lens.sum()), dtype=np.uint16)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    body = np.ones(len(out), dtype=bool)
    body[starts] = False
    out[starts] = BOS_ID
    out[body] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint16, count=len(out) - len(ids))
    return out


def _tokenize_task(task: tuple) -> tuple[np.ndarray, int, int]:
    """(token stream with a BOS before each document, documents, characters)."""
    if task[0] == "docs":
        docs = task[1]
    else:
        import pyarrow.parquet as pq

        _, path, rg, part, parts = task
        try:
            column = pq.ParquetFile(path).read_row_group(rg, columns=["text"]).column(0)
        except Exception as e:
            raise PrepareError(
                f"cannot read parquet shard {path}: {e}; delete or replace the file and run prepare again"
            ) from e
        n = len(column)
        lo, hi = n * part // parts, n * (part + 1) // parts
        docs = [t for t in column.slice(lo, hi - lo).to_pylist() if t]
    if not docs:
        return np.empty(0, dtype=np.uint16), 0, 0
    return _encode_docs(_worker_tok, docs), len(docs), sum(map(len, docs))


def _tokenize_split(source: Source, split: str, tokenizer_path: Path, out_path: Path,
                    log: Callable[[str], None]) -> dict[str, Any]:
    """Tokenise one split into out_path in task order (deterministic); returns its stats."""
    digest = hashlib.sha256()
    tokens = docs = chars = 0
    t0 = time.time()
    # fork: workers inherit everything and re-import nothing (train.py may be __main__).
    ctx = multiprocessing.get_context("fork")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; also silences the fork warning
    try:
        with open(out_path, "wb") as f, ctx.Pool(_workers(), _worker_init, (str(tokenizer_path),)) as pool:
            for arr, n_docs, n_chars in pool.imap(_tokenize_task, source.tasks(split)):
                f.write(arr.tobytes())
                digest.update(arr.tobytes())
                tokens += len(arr)
                docs += n_docs
                chars += n_chars
            f.flush()
            os.fsync(f.fileno())
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    log(f"{split}: {docs:,} documents, {chars / 1e6:,.1f}M characters -> {tokens:,} tokens "
        f"in {time.time() - t0:.1f}s")
    return {"tokens": tokens, "documents": docs, "characters": chars, "sha256": digest.hexdigest()}


# ---------------------------------------------------------------------------
# The cache: build in a temporary directory, publish by rename, manifest last


@dataclasses.dataclass(frozen=True)
class PreparedData:
    """A published, checked cache directory and its manifest."""

    path: Path
    manifest: dict[str, Any]

    def file(self, name: str) -> Path:
        return self.path / name

    def sha256(self, name: str) -> str:
        return self.manifest["files"][name]["sha256"]

    @property
    def profile(self) -> str:
        return self.manifest["profile"]

    @property
    def source(self) -> str:
        return self.manifest["source"]

    def tokens(self, split: str) -> np.ndarray:
        return np.memmap(self.file(f"{split}.bin"), dtype=np.uint16, mode="r")

    def token_bytes(self) -> np.ndarray:
        return np.load(self.file("token_bytes.npy"))


def _data_dir(source: Source, prof: Profile) -> Path:
    config = {
        "format": CACHE_FORMAT,
        "profile": prof.name,
        "vocab_size": prof.vocab_size,
        "tokenizer_train_chars": prof.tokenizer_train_chars,
        "special_tokens": SPECIAL_TOKENS,
        "split_pattern": SPLIT_PATTERN,
        "val_fraction": VAL_FRACTION,
        "source": {"kind": source.kind, **source.identity()},
    }
    return cache_root() / "data" / f"{prof.name}-{source.kind}-{_fingerprint(config)[:16]}"


def load_prepared(path: str | Path, verify: str = "size") -> PreparedData:
    """Open a published cache directory; verify="size" checks sizes, "full" also sha256."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not path.is_dir():
        raise CacheError(f"prepared data directory {path} does not exist; run prepare.py")
    if not manifest_path.is_file():
        raise CacheError(f"{path} has no manifest.json, so it is half-written; run prepare.py to rebuild it")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("format") != CACHE_FORMAT:
            raise ValueError(f"format {manifest.get('format')} is not {CACHE_FORMAT}")
    except (ValueError, KeyError, TypeError) as e:
        raise CacheError(f"manifest {manifest_path} is unreadable ({e}); delete {path} and run prepare.py") from e
    for name, info in files.items():
        p = path / name
        if not p.is_file():
            raise CacheError(f"{p} is missing; the cache {path} is corrupt, run prepare.py to rebuild it")
        if p.stat().st_size != info["bytes"]:
            raise CacheError(
                f"{p} has {p.stat().st_size} bytes, the manifest says {info['bytes']}; "
                f"the cache {path} is corrupt, run prepare.py to rebuild it"
            )
        if verify == "full" and _sha256(p) != info["sha256"]:
            raise CacheError(f"{p} does not match its sha256 in {manifest_path}; run prepare.py to rebuild it")
    return PreparedData(path, manifest)


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _build(source: Source, prof: Profile, tmp: Path, log: Callable[[str], None]) -> None:
    t0 = time.time()
    source.fetch(log)
    log(f"training a {prof.vocab_size}-token BPE on up to {prof.tokenizer_train_chars / 1e6:,.0f}M characters")
    tok = train_tokenizer(source.docs("train"), prof.vocab_size, prof.tokenizer_train_chars)
    tok.save(str(tmp / "tokenizer.json"))
    np.save(tmp / "token_bytes.npy", token_byte_lengths(tok, prof.vocab_size))
    _fault("tokenizer")
    stats = {}
    for split in ("train", "val"):
        stats[split] = _tokenize_split(source, split, tmp / "tokenizer.json", tmp / f"{split}.bin", log)
        _fault(f"{split}.bin")
    if stats["val"]["tokens"] < prof.max_seq_len + 1:
        raise PrepareError(
            f"the validation split of {source.spec} has {stats['val']['tokens']} tokens; the {prof.name} "
            f"profile needs at least {prof.max_seq_len + 1}; add data to the source"
        )
    if stats["train"]["tokens"] < prof.max_seq_len + 1:
        raise PrepareError(f"the training split of {source.spec} has {stats['train']['tokens']} tokens; add data")
    files = {}
    for name in ("tokenizer.json", "token_bytes.npy", "train.bin", "val.bin"):
        p = tmp / name
        sha = stats[name[:-4]]["sha256"] if name.endswith(".bin") else _sha256(p)
        files[name] = {"bytes": p.stat().st_size, "sha256": sha}
    manifest = {
        "format": CACHE_FORMAT,
        "profile": prof.name,
        "source": source.spec,
        "source_kind": source.kind,
        "identity": source.identity(),
        "vocab_size": prof.vocab_size,
        "tokenizer_vocab": tok.get_vocab_size(),
        "special_tokens": SPECIAL_TOKENS,
        "bos_id": BOS_ID,
        "dtype": "uint16",
        "splits": {s: {k: v for k, v in st.items() if k != "sha256"} for s, st in stats.items()},
        **source.describe(),
        "files": files,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - t0, 1),
    }
    _fault("manifest")
    (tmp / "manifest.json.tmp").write_text(json.dumps(manifest, indent=1))
    os.replace(tmp / "manifest.json.tmp", tmp / "manifest.json")
    _fsync_dir(tmp)


def prepare(source: str = "hub", *, profile: str | None = None, num_shards: int | None = None,
            endpoint: str | None = None, verify: str = "size",
            log: Callable[[str], None] = _log) -> PreparedData:
    """Make sure `source` is prepared for `profile` (default: the active one); return it.

    Idempotent: a valid cache is returned as is. A half-written or corrupt one
    is discarded and rebuilt. Raises PrepareError naming the path at fault.
    """
    prof = _profile(profile)
    src = make_source(source, profile=prof, num_shards=num_shards, endpoint=endpoint)
    target = _data_dir(src, prof)
    data_root = target.parent
    with _locked(data_root / f".{target.name}.lock"):
        if target.exists():
            try:
                prepared = load_prepared(target, verify=verify)
                _remember_source(src.spec)
                return prepared
            except CacheError as e:
                log(f"discarding unusable cache: {e}")
                trash = data_root / f".trash-{target.name}-{os.getpid()}"
                os.rename(target, trash)
                shutil.rmtree(trash, ignore_errors=True)
        for stale in data_root.glob(f".tmp-{target.name}-*"):  # left by a killed build; we hold the lock
            log(f"removing half-built {stale}")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = data_root / f".tmp-{target.name}-{os.getpid()}"
        tmp.mkdir(parents=True)
        log(f"preparing {src.spec} for the {prof.name} profile in {target}")
        try:
            _build(src, prof, tmp, log)
            os.rename(tmp, target)
            _fsync_dir(data_root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        prepared = load_prepared(target, verify="size")
    _remember_source(src.spec)
    log(f"ready: {target}")
    return prepared


def _remember_source(spec: str) -> None:
    path = cache_root() / "last_source"
    tmp = path.with_name(f".last_source.{os.getpid()}")
    tmp.write_text(spec + "\n")
    os.replace(tmp, path)


_active: PreparedData | None = None


def active_data() -> PreparedData:
    """The prepared data this process trains and evaluates on.

    $AUTOLAB_DATA_DIR (set by the run harness) names it exactly and is never
    rebuilt here. Otherwise the source is $AUTOLAB_SOURCE or the one prepared
    last, and it is prepared for the active profile if it is not yet.
    """
    global _active
    if _active is not None:
        return _active
    exact = os.environ.get("AUTOLAB_DATA_DIR")
    if exact:
        prepared = load_prepared(exact)
        if prepared.profile != PROFILE:
            raise CacheError(f"{exact} was prepared for the {prepared.profile} profile, this is {PROFILE}")
    else:
        source = os.environ.get("AUTOLAB_SOURCE")
        remembered = cache_root() / "last_source"
        if not source and remembered.is_file():
            source = remembered.read_text().strip()
        if not source:
            raise PrepareError(
                f"no prepared data in {cache_root()}; run `python prepare.py --source synthetic` "
                "(or hub, or dir:PATH) first"
            )
        prepared = prepare(source)
    _active = prepared
    return prepared


# ---------------------------------------------------------------------------
# Loader


DATA_FD_ENV = "AUTOLAB_DATA_FD"  # set by the run harness: the socket the training stream comes from
STREAM_READ, STREAM_DONE = b"R", b"D"  # requests: the next n tokens; training is over
STREAM_REQUEST = "<cQ"  # one request: an opcode byte and a count (little-endian)
STREAM_MAX_TOKENS = 2**26  # the most tokens one request may ask for


def _stream_socket():
    """The harness's data socket in a sandboxed run, else None (a run by hand)."""
    import socket

    fd = os.environ.get(DATA_FD_ENV)
    if not fd:
        return None
    return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM, fileno=int(fd))


_stream = None


def _read_stream(n: int) -> np.ndarray:
    """The next n training tokens from the harness (which starts its clock at the first call)."""
    global _stream
    if _stream is None:
        _stream = _stream_socket()
    import struct

    _stream.sendall(struct.pack(STREAM_REQUEST, STREAM_READ, n))
    buf = bytearray(2 * n)
    view, got = memoryview(buf), 0
    while got < len(buf):
        k = _stream.recv_into(view[got:])
        if not k:
            raise PrepareError("the harness closed the training stream (the run is over)")
        got += k
    return np.frombuffer(buf, dtype=np.uint16)


def training_done() -> None:
    """Tell the harness training is over (export_model calls it): its clock stops here and it
    streams no more data. A no-op in a run by hand."""
    global _stream
    if _stream is None:
        _stream = _stream_socket()
    if _stream is not None:
        import struct

        try:
            _stream.sendall(struct.pack(STREAM_REQUEST, STREAM_DONE, 0))
        except OSError:
            pass


def make_loader(split: str, batch_size: int, seq_len: int = MAX_SEQ_LEN, device: Any = "cpu",
                *, seed: int = 0) -> Iterator[tuple[Any, Any]]:
    """Yield (x, y) int64 tensors of shape (batch_size, seq_len), y = x shifted by one.

    Batches are consecutive windows of the token stream. Under the run harness the training
    split arrives over a socket (the candidate never sees the data files, and the harness's
    clock starts at the first batch); run by hand, the stream is read from the prepared
    files, from a seeded start offset, wrapping at the end. Nothing is read until the first
    `next()`: compile and warm up before asking for data. A background thread fills pinned
    host memory and the next batch's copy to the device is issued before the current one is
    yielded.
    """
    import torch

    span = batch_size * seq_len + 1
    if os.environ.get(DATA_FD_ENV):
        if split != "train":
            raise PrepareError(f"only the training split is available to train.py, not {split!r}")
        read = _read_stream
    else:
        tokens = active_data().tokens(split)
        if len(tokens) < span:
            raise PrepareError(
                f"the {split} split has {len(tokens)} tokens, fewer than one batch of {batch_size}x{seq_len}; "
                "use a smaller batch or more data"
            )
        rng = np.random.default_rng(seed)
        pos = [int(rng.integers(0, seq_len))]

        def read(n: int) -> np.ndarray:
            out = []
            while n:
                if pos[0] >= len(tokens):
                    pos[0] = int(rng.integers(0, seq_len))
                take = min(n, len(tokens) - pos[0])
                out.append(np.asarray(tokens[pos[0] : pos[0] + take]))
                pos[0] += take
                n -= take
            return np.concatenate(out)

    device = torch.device(device)
    pin = device.type == "cuda"
    batches: queue.Queue = queue.Queue(maxsize=3)

    def produce() -> None:
        try:
            carry = read(1)  # windows overlap by one token: the last target is the next input
            while True:
                chunk = torch.from_numpy(np.concatenate([carry, read(span - 1)]).astype(np.int64))
                carry = chunk[-1:].numpy().astype(np.uint16)
                x, y = chunk[:-1].view(batch_size, seq_len), chunk[1:].view(batch_size, seq_len)
                if pin:
                    x, y = x.pin_memory(), y.pin_memory()
                batches.put((x, y))
        except Exception as e:  # handed to the training loop, which would otherwise wait forever
            batches.put(e)

    def to_device(batch):
        if isinstance(batch, Exception):
            raise batch
        return tuple(t.to(device, non_blocking=True) for t in batch)

    def iterate() -> Iterator[tuple[Any, Any]]:
        threading.Thread(target=produce, daemon=True, name=f"loader-{split}").start()
        nxt = to_device(batches.get())
        while True:
            cur, nxt = nxt, to_device(batches.get())
            yield cur

    return iterate()


# ---------------------------------------------------------------------------
# The metric


def _model_device(model: Any):
    import torch

    for t in itertools.chain(getattr(model, "parameters", lambda: [])(), getattr(model, "buffers", lambda: [])()):
        return t.device
    return torch.device("cpu")


def evaluate_bpb(model: Callable, batch_size: int = EVAL_BATCH_SIZE, *, tokens: np.ndarray | None = None,
                 token_bytes: np.ndarray | None = None, seq_len: int = MAX_SEQ_LEN,
                 eval_tokens: int = EVAL_TOKENS, device: Any = None,
                 probe: Callable[[int, list[int], Any, Any], None] | None = None) -> float:
    """Validation bits per byte of `model` (idx (B, T) -> logits (B, T, V)).

    The first eval_tokens tokens of the validation stream are cut into W
    windows of seq_len inputs (targets: the next token), scored in
    n = ceil(W / batch_size) calls in a strided order: call k holds windows
    k, k+n, k+2n, ..., so no row of a batch is the continuation of another
    (a model reading across rows finds no target there). Rows past W are
    padded with a repeat of window k and not scored. Every window is scored
    once, so the sum is the one a consecutive order gives.
    bpb = sum of cross-entropy (nats) over target tokens / (ln 2 * their bytes),
    where targets that are special tokens (0 bytes, e.g. BOS) are left out of
    both sums. Each prediction is scored over the text tokens alone (the
    special tokens' logits, and any past the byte table, are set to -inf for
    every model alike): a target that is never scored has no probability
    worth keeping, so a model that gave them none would otherwise gain
    -log(1 - p(special)) on every scored token for nothing it learned.
    Deterministic for the same weights on the same device.
    probe(k, windows, x, logits), if given, sees every scored batch (the
    evaluator's causality check runs there).
    """
    import torch
    import torch.nn.functional as F

    if tokens is None:
        tokens = active_data().tokens("val")
    if token_bytes is None:
        token_bytes = active_data().token_bytes()
    device = torch.device(device) if device is not None else _model_device(model)
    windows = min(eval_tokens, len(tokens) - 1) // seq_len
    if windows < 1:
        raise PrepareError(f"the validation split has {len(tokens)} tokens, fewer than one window of {seq_len}")
    stream = torch.from_numpy(np.asarray(tokens[: windows * seq_len + 1], dtype=np.int64))
    table = torch.from_numpy(np.asarray(token_bytes, dtype=np.int64)).to(device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = torch.zeros((), dtype=torch.int64, device=device)
    batches = -(-windows // batch_size)
    not_text = None  # (V,) True for the logits no prediction is scored over
    with torch.no_grad():
        for k in range(batches):
            rows = [k + j * batches for j in range(batch_size)]  # strided: no row continues another
            valid = torch.tensor([w < windows for w in rows], device=device)
            rows = [w if w < windows else k for w in rows]  # padding, not scored
            idx = torch.tensor(rows)[:, None] * seq_len + torch.arange(seq_len + 1)[None, :]
            window = stream[idx].to(device)
            x, y = window[:, :-1].clone(), window[:, 1:]  # x owns its memory: writing to it cannot reach y
            logits = model(x)
            if tuple(logits.shape[:2]) != (batch_size, seq_len) or logits.dim() != 3:
                raise ValueError(f"model returned logits of shape {tuple(logits.shape)}, "
                                 f"expected ({batch_size}, {seq_len}, vocab)")
            if probe is not None:
                probe(k, rows, x, logits)
            vocab = logits.size(-1)
            if not_text is None or not_text.numel() != vocab:
                not_text = torch.ones(vocab, dtype=torch.bool, device=device)
                known = min(vocab, table.numel())
                not_text[:known] = table[:known] == 0
            text_logits = torch.where(not_text, float("-inf"), logits.float())
            ce = F.cross_entropy(text_logits.reshape(-1, vocab), y.reshape(-1), reduction="none")
            b = table[y]
            scored = (b > 0) & valid[:, None]
            nats += torch.where(scored, ce.view(batch_size, seq_len), 0.0).sum(dtype=torch.float64)
            nbytes += torch.where(scored, b, 0).sum()
    return float(nats.item() / (math.log(2) * max(int(nbytes.item()), 1)))


# ---------------------------------------------------------------------------
# Hooks train.py calls: the step curve and the export of the trained model

_curve_last_step: int | None = None


def report_step(step: int, loss: float, tokens_per_sec: float) -> None:
    """Append {"step", "loss", "tokens_per_sec", "time"} to $AUTOLAB_CURVE_PATH, at most
    one line per CURVE_EVERY_STEPS steps; a no-op when the variable is unset."""
    global _curve_last_step
    path = os.environ.get("AUTOLAB_CURVE_PATH")
    if not path or (_curve_last_step is not None and step - _curve_last_step < CURVE_EVERY_STEPS):
        return
    _curve_last_step = step
    line = {"step": int(step), "loss": float(loss), "tokens_per_sec": float(tokens_per_sec), "time": time.time()}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def export_program(module: Any, example: Any, autocast: bool) -> Any:
    """The torch.export program of module(idx) -> logits for `example`'s shape, as the evaluator
    loads it: no gradients, state as parameters and buffers, no example inputs kept (saved, they
    would be a pickle; the evaluator refuses archives with one). With `autocast` the program runs
    the module under bf16 autocast, the region inside the graph (export_model sets it on CUDA;
    the evaluator's rehearsal exports its toy the same way)."""
    import torch

    class AutocastLogits(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.model = inner

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            if autocast:
                with torch.autocast(idx.device.type, dtype=torch.bfloat16):
                    return self.model(idx)
            return self.model(idx)

    with torch.no_grad():
        program = torch.export.export(AutocastLogits(module), (example,), strict=False)
    program.example_inputs = None
    return program


def export_model(model: Any, stats: dict[str, Any], export_dir: str | os.PathLike | None = None) -> Path | None:
    """Export the trained model for the harness's evaluator; returns the directory.

    Writes `model.pt2` (torch.export program of model(idx) -> logits for one
    fixed input shape, (EVAL_BATCH_SIZE, MAX_SEQ_LEN); on CUDA the program
    runs the model under bf16 autocast) and then `stats.json` (the training
    statistics: informational). Without export_dir or $AUTOLAB_EXPORT_DIR
    (a run by hand) it does nothing and returns None.
    """
    import torch

    training_done()
    export_dir = export_dir or os.environ.get("AUTOLAB_EXPORT_DIR")
    if not export_dir:
        return None
    out = Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = getattr(model, "_orig_mod", model)  # the uncompiled module
    module.eval()
    device = _model_device(module)
    example = torch.zeros(EVAL_BATCH_SIZE, MAX_SEQ_LEN, dtype=torch.long, device=device)
    t0 = time.time()
    program = export_program(module, example, autocast=device.type == "cuda")
    torch.export.save(program, str(out / "model.tmp.pt2"))
    os.replace(out / "model.tmp.pt2", out / "model.pt2")
    record = {**{k: v for k, v in stats.items()}, "export_device": str(device),
              "export_seconds": round(time.time() - t0, 2)}
    (out / "stats.json.tmp").write_text(json.dumps(record, default=str))
    os.replace(out / "stats.json.tmp", out / "stats.json")
    return out


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
