"""The prepared-data cache: build in a temporary directory, publish by rename, manifest last.

`$AUTOLAB_CACHE` (default `~/.cache/autolab`) holds one directory per (profile, source
fingerprint) under `data/`. `prepare(source)` builds it under a lock, in a temporary directory,
and publishes it by one atomic rename with `manifest.json` (sizes and sha256 of every file)
written last. A directory without a valid manifest, or whose files disagree with it, is never
used: it is rebuilt. `load_prepared` opens a published one; `active_data` is the one this process
trains and evaluates on ($AUTOLAB_DATA_DIR, set by the run harness, names it exactly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prepare import (BOS_ID, CACHE_FORMAT, CacheError, PROFILE, PrepareError, Profile, SPECIAL_TOKENS,
                     SPLIT_PATTERN, VAL_FRACTION, _fault, _fingerprint, _log, _profile, _sha256, cache_root)
from prepare_sources import Source, make_source
from prepare_tokenizer import _tokenize_split, token_byte_lengths, train_tokenizer


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
