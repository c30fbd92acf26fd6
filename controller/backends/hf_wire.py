"""What travels between the controller and a Hugging Face job: the bundle in, signed lines out.

In: the job has no copy of the lab, so its files (the pinned harness, the candidate as the
surface, `bench/hf_entry.py`) travel in the job spec as a deterministic xz-compressed tarball,
base64, in environment variables of at most BUNDLE_PART characters each (one environment string
must stay under Linux's 128 KiB MAX_ARG_STRLEN), BUNDLE_LIMIT in all; BOOTSTRAP, run as
`python3 -c BOOTSTRAP ...`, joins and unpacks them and execs the entry point.

Out: the job's log, which the candidate can write into too. The controller believes only lines
signed with HMAC-SHA256 under the run's key (bench/hf_entry.py signs them): the result, which
must name the run and the candidate's sha1, and the step curve, every point checked. Pure
functions and constants; `hf` (the backend's run logic) and `hf_api` (its log reader) use them.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import lzma
import math
import re
import tarfile
from typing import Any, Iterable, Iterator

from controller.backends.results import wrong_candidate
from controller.core.errors import InputError

BUNDLE_ENV = "AUTOLAB_BUNDLE"
BUNDLE_PART = 96 * 1024    # characters of base64 in one environment variable
BUNDLE_LIMIT = 4 * BUNDLE_PART  # in all: the harness is ~80 KiB of it, the candidate the rest

# The job's signed lines (bench/hf_entry.py writes them), and what of them is kept.
SIGNED_LINE = re.compile(r"AUTOLAB_SIGNED_RESULT (v1) ([A-Za-z0-9_=-]+) ([0-9a-f]{64})")
CURVE_LINE = re.compile(r"AUTOLAB_SIGNED_CURVE (curve-v1) ([A-Za-z0-9_=-]+) ([0-9a-f]{64})")
RESULT_MARKER, CURVE_MARKER = "AUTOLAB_SIGNED_RESULT", "AUTOLAB_SIGNED_CURVE"
MAX_CURVE_LINES = 256         # the last lines with the curve marker (ours: at most 100)
MAX_CURVE_POINTS = 5000       # bench/hf_entry.py CURVE_MAX_POINTS
CURVE_KEYS = ("loss", "tokens_per_sec", "time")
MAX_CURVE_STEP = 10**12

# Unpack the bundle into a fresh directory and exec the entry point there. Runs as
# `python3 -c BOOTSTRAP ARGS...`, so sys.argv[1:] are the entry point's arguments.
BOOTSTRAP = (
    "import base64,io,os,sys,tarfile,tempfile\n"
    "d=tempfile.mkdtemp(prefix='autolab-job-')\n"
    f"b=os.environ.pop('{BUNDLE_ENV}');i=1\n"
    f"while '{BUNDLE_ENV}_%d'%i in os.environ:b+=os.environ.pop('{BUNDLE_ENV}_%d'%i);i+=1\n"
    "t=tarfile.open(fileobj=io.BytesIO(base64.b64decode(b)),mode='r:xz')\n"
    "t.extractall(d,**({'filter':'data'} if hasattr(tarfile,'data_filter') else {}))\n"
    "e=os.path.join(d,'bench','hf_entry.py')\n"
    "os.execv(sys.executable,[sys.executable,e]+sys.argv[1:])\n"
)


def make_bundle(files: dict[str, bytes]) -> str:
    """An xz-compressed tarball of `files` (archive path -> bytes), base64; the same bytes every
    time. (xz: Python source packs ~15 % smaller than with gzip.)"""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[name]))
    return base64.b64encode(lzma.compress(raw.getvalue(), preset=9)).decode()


def bundle_env(bundle: str) -> dict[str, str]:
    """The bundle in environment variables of at most BUNDLE_PART characters each, in the names
    BOOTSTRAP joins: AUTOLAB_BUNDLE, AUTOLAB_BUNDLE_1, ..."""
    parts = [bundle[i:i + BUNDLE_PART] for i in range(0, len(bundle), BUNDLE_PART)] or [""]
    return {BUNDLE_ENV if i == 0 else f"{BUNDLE_ENV}_{i}": part for i, part in enumerate(parts)}


class BundleTooLarge(InputError, ValueError):
    pass


def _signed_payloads(lines: Iterable[str], pattern: re.Pattern, key: bytes,
                     run: str) -> Iterator[dict]:
    """The JSON objects of the lines `pattern` finds whose HMAC verifies under `key` and that
    name `run`, in order. `pattern`'s groups: version, base64 payload, hex MAC."""
    for line in lines:
        m = pattern.search(line)
        if not m:
            continue
        version, b64, mac = m.groups()
        want = hmac.new(key, f"{version} {b64}".encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(want, mac):
            continue
        try:
            payload = json.loads(base64.urlsafe_b64decode(b64.encode()))
        except ValueError:  # binascii.Error and JSONDecodeError are ValueErrors
            continue
        if isinstance(payload, dict) and payload.get("run") == run:
            yield payload


def verify_signed_result(lines: Iterable[str], key: bytes, run: str,
                         candidate_sha1: str | None = None) -> dict | None:
    """The harness result of the last line signed with `key` for `run` (and, when given, for
    the candidate with this sha1); None if no line is."""
    found = None
    for payload in _signed_payloads(lines, SIGNED_LINE, key, run):
        if not isinstance(payload.get("result"), dict):
            continue
        result = payload["result"]
        # A measurement of another program is not this run's, whoever signed it (the line's
        # signature stands for the result's own, and its `run` was checked with it).
        if candidate_sha1 and wrong_candidate(result, candidate_sha1):
            continue
        found = result
    return found



def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _curve_point(p: Any) -> dict | None:
    """One point of a step curve, every number checked; None if it is not one."""
    if not isinstance(p, dict) or not _is_int(p.get("step")) \
            or not 0 <= p["step"] <= MAX_CURVE_STEP:
        return None
    point: dict[str, Any] = {"step": p["step"]}
    for k in CURVE_KEYS:
        v = p.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            point[k] = v
    return point if len(point) > 1 else None


def verify_signed_curve(lines: Iterable[str], key: bytes | None, run: str) -> list[dict]:
    """The step curve of the verified curve lines for `run` (bench/hf_entry.py sign_curve):
    its parts in order, every point checked, at most MAX_CURVE_POINTS. [] if none verifies."""
    if not key:
        return []
    parts: dict[int, list] = {}
    total = None
    for payload in _signed_payloads(lines, CURVE_LINE, key, run):
        part, n, points = payload.get("part"), payload.get("parts"), payload.get("points")
        if not (_is_int(part) and _is_int(n) and 0 <= part < n <= MAX_CURVE_LINES
                and isinstance(points, list)):
            continue
        if n != total:  # another curve (a second run of the harness?): the last one counts
            parts, total = {}, n
        parts[part] = points
    curve: list[dict] = []
    for i in sorted(parts):
        for p in parts[i]:
            point = _curve_point(p)
            if point is not None:
                curve.append(point)
            if len(curve) >= MAX_CURVE_POINTS:
                return curve
    return curve
