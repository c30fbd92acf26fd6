"""The tokenizer and the tokenisation of a split.

A byte-level BPE tokenizer (GPT-4 style pre-tokenisation, so every byte sequence is
representable and nothing is <unk>) is trained on the training split; the byte length of every
token (`token_byte_lengths`) is what turns the metric's nats per token into bits per byte. Each
split is tokenised once, in a pool of forked workers, into a uint16 token stream: a BOS token,
then the document, for every document, concatenated.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from prepare import BOS_ID, BOS_TOKEN, PrepareError, SPECIAL_TOKENS, SPLIT_PATTERN, TOKENIZER_DOC_CHARS
from prepare_sources import Source, _workers


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
