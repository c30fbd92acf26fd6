"""The training stream: data in, time measured.

The candidate sees no data file. A thread of the harness (`DataServer`) streams the training
split to it over a socket, batch by batch, and that is how the harness times the run from
outside its reach: the clock starts at the candidate's first request (compiling and warming up
come before it) and stops when it says training is done (`prepare.export_model` does) or its
socket closes. The tokens it served are the harness's own count for MFU.

A run started ahead of its turn (`--gate FILE`) is held at its first request by a `Gate` until
the controller removes the file; see harness_one_run for when that happens.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from pathlib import Path

import prepare  # the trusted one, next to this file


# --gate: a run started while the run before it on the same GPU is evaluated waits at its first
# batch until the controller removes the gate file (that run's verdict is in). How often the gate
# is looked at, and how long a candidate may wait there before the run is given up.
GATE_POLL_SECONDS = 0.05
GATE_LIMIT_SECONDS = 1800.0


class Gate:
    """--gate FILE: the first batch waits while FILE exists; --gate-owner-fd FD: the controller that
    made the gate, alive while the pipe FD reads nothing (it never writes; end of file = gone)."""

    def __init__(self, path: Path, owner_fd: int | None = None) -> None:
        self.path = path
        self.given_up: str | None = None  # why the run stopped waiting (an error, not the candidate's)
        self.owner_gone = threading.Event()
        if owner_fd is not None:
            def watch() -> None:
                with contextlib.suppress(OSError):
                    while os.read(owner_fd, 1):
                        pass
                self.owner_gone.set()
            threading.Thread(target=watch, daemon=True, name="gate-owner").start()

    def closed(self) -> bool:
        return os.path.lexists(self.path)

    def abandoned(self) -> str | None:
        """Why this run gives up waiting, if it does: its controller is gone while the gate is closed."""
        if self.given_up is None and self.owner_gone.is_set() and self.closed():
            self.given_up = ("the controller that started this run ahead of its turn is gone, and nobody will "
                             "open its gate; nothing was measured (the next `autolab run` starts it again)")
        return self.given_up


class DataServer:
    """Streams the training split to the candidate over a socket and notes the time.

    The candidate asks for n tokens at a time (prepare.make_loader); it gets the
    next n of a sequential pass over train.bin from a seeded offset, wrapping at
    the end. The first request starts the harness's clock; a "done" request (or
    the end of the connection) stops it, and nothing more is served. With a gate
    (a run started up beside the one before it, see --gate), the first request
    is answered only once the gate file is gone: the clock starts then.
    """

    def __init__(self, tokens, conn: socket.socket, seed: int, gate: Gate | None = None,
                 hold: bool = False) -> None:
        self.tokens, self.conn = tokens, conn
        self.pos = seed % max(1, len(tokens))
        self.gate = gate  # while this file exists the first batch waits (the GPU is not ours yet)
        self.hold = hold  # a warm-up: its first request is noted and never answered (no data served)
        self.asked: float | None = None  # the first request came (the candidate is ready)
        self.first: float | None = None
        self.first_wall: float | None = None  # the same moment on the wall clock (other runs' timelines)
        self.done: float | None = None
        self.served = 0
        self.thread = threading.Thread(target=self._serve, daemon=True, name="data-server")

    def _recv(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            part = self.conn.recv(n - len(buf))
            if not part:
                return None
            buf += part
        return buf

    def _next(self, n: int) -> bytes:
        parts = []
        while n:
            if self.pos >= len(self.tokens):
                self.pos = 0
            take = min(n, len(self.tokens) - self.pos)
            parts.append(self.tokens[self.pos:self.pos + take].tobytes())
            self.pos += take
            n -= take
        return b"".join(parts)

    def _serve(self) -> None:
        size = struct.calcsize(prepare.STREAM_REQUEST)
        try:
            while True:
                req = self._recv(size)
                if req is None:
                    break
                op, n = struct.unpack(prepare.STREAM_REQUEST, req)
                if op == prepare.STREAM_DONE or op != prepare.STREAM_READ:
                    break
                if self.first is None:
                    self.asked = time.monotonic()
                    if self.hold:  # no answer, and no end of stream it could mistake for one
                        self.conn.recv(1)  # until it is stopped and its end closed
                        break
                    while self.gate is not None and self.gate.closed():
                        if time.monotonic() - self.asked > GATE_LIMIT_SECONDS:
                            self.gate.given_up = (f"the GPU was not handed over within {GATE_LIMIT_SECONDS:g}s "
                                                  "of waiting at the gate; nothing was measured")
                        if self.gate.abandoned():
                            raise OSError(self.gate.given_up)
                        time.sleep(GATE_POLL_SECONDS)
                    self.first = time.monotonic()
                    self.first_wall = time.time()
                n = min(n, prepare.STREAM_MAX_TOKENS)
                self.conn.sendall(self._next(n))
                self.served += n
        except OSError:
            pass
        finally:
            if self.done is None:
                self.done = time.monotonic()
            try:
                self.conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def start(self) -> "DataServer":
        self.thread.start()
        return self
