"""Where the benchmark's documents come from: the Hub, a local directory, or a generator.

* `hub`: shards of karpathy/climbmix-400b-shuffle, downloaded into `$AUTOLAB_CACHE/downloads`
  (they survive rebuilds), validation pinned to shard_06542;
* `dir:PATH`: parquet shards in the same layout, or text files (a share of the documents held
  out for validation);
* `synthetic`: generated documents; the validation split's seed is a secret of the cache
  (`synthetic_seed`), so no candidate can generate it.

`make_source` turns a source string into one of them. A source yields tokenisation tasks per
split; a task is either ("parquet", path, row_group, part, parts) or ("docs", [text, ...]).
prepare_tokenizer's workers turn tasks into token arrays, so large parquet shards are read and
tokenised in parallel without passing text between processes.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

from prepare import (HUB_REPO, HUB_REVISION, PrepareError, Profile, TEXT_SUFFIXES, VAL_FRACTION, VAL_SHARD,
                     _fault, _profile, cache_root)


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
