"""The training loader: batches of token windows, from the harness's stream or from the cache.

In a run by the harness the candidate sees no data files: `make_loader("train", ...)` asks the
harness for tokens over the socket `$AUTOLAB_DATA_FD` (the harness starts its clock at the first
request), and `training_done` tells it training is over (export_model calls it). Run by hand it
reads the prepared split through `np.memmap`. Either way sequential windows, pinned memory and a
background thread keep the GPU from waiting for data.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from prepare import MAX_SEQ_LEN, PrepareError
from prepare_cache import active_data


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
