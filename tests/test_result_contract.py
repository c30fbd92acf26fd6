"""One result contract: every backend believes the same results and refuses the same forgeries.

A result reaches the controller in a file (local), a Pod's termination message (Kubernetes) or a
signed log line (Hugging Face). Whatever carried it, a result signed with another key, for
another run, or for another program is refused; a genuine one is believed. The table below is
run through `authentic` (what the local and Kubernetes backends ask) and through
`verify_signed_result` on the line bench/hf_entry.py prints (what the HF backend asks).
"""

from __future__ import annotations

import json

import pytest
from hf_server import _entry_module

from controller.backends.hf_wire import verify_signed_result
from controller.backends.local import LocalBackend
from controller.backends.results import authentic, result_signature

KEY, RUN, SHA1 = b"the run's key", "exp-lr-up-1", "a" * 40
OTHER_SHA1 = "b" * 40


def harness(status: str = "succeeded", sha1: str | None = SHA1, run: str = RUN) -> dict:
    """A result as bench/run.py writes it, before signing."""
    out = {"version": 2, "run": run, "status": status, "candidate_sha1": sha1}
    if status == "succeeded":
        out["metrics"] = {"val_bpb": 0.98, "training_seconds": 300.0}
    else:
        out["reason"] = "the harness could not read the candidate"
    return out


# (what the forger did, the result, the key it was signed with, the refusal's words or None)
CASES = [
    ("nothing: a genuine result", harness(), KEY, None),
    ("a harness error without a sha1", harness("error", sha1=None), KEY, None),
    ("signed with a key of its own", harness(), b"a guessed key", "signature does not verify"),
    ("replayed from another run", harness(run="exp-other-1"), KEY, "names the run"),
    ("measured another program", harness(sha1=OTHER_SHA1), KEY, "another program"),
    ("a failure naming another program", harness("failed", sha1=OTHER_SHA1), KEY,
     "another program"),
    ("succeeded without naming its candidate", harness(sha1=None), KEY,
     "does not name the candidate"),
]


def signed(result: dict, key: bytes) -> dict:
    return {**result, "signature": result_signature(key, result)}


@pytest.mark.parametrize("what, result, key, refusal", CASES, ids=[c[0] for c in CASES])
def test_a_result_file_is_believed_only_if_it_keeps_the_contract(what, result, key, refusal):
    wrong = authentic(signed(result, key), KEY, RUN, SHA1)
    assert (wrong is None) if refusal is None else (refusal in (wrong or "")), wrong


@pytest.mark.parametrize("what, result, key, refusal", CASES, ids=[c[0] for c in CASES])
def test_a_signed_log_line_is_believed_for_the_same_results(what, result, key, refusal):
    line = _entry_module().sign_result(key, result["run"], json.dumps(result))
    found = verify_signed_result([line], KEY, RUN, SHA1)
    assert (found == result) if refusal is None else (found is None)


@pytest.mark.parametrize("what, result, key, refusal", CASES, ids=[c[0] for c in CASES])
def test_the_local_backend_asks_the_same_contract(tmp_path, what, result, key, refusal):
    backend = LocalBackend(tmp_path)
    backend.run_dir(RUN).mkdir(parents=True)
    (backend.run_dir(RUN) / "key").write_bytes(KEY)  # as submit writes it
    wrong = backend._authentic(RUN, {"candidateSha1": SHA1}, signed(result, key))
    assert wrong == authentic(signed(result, key), KEY, RUN, SHA1)


def test_a_metric_changed_after_signing_is_refused():
    result = signed(harness(), KEY)
    result["metrics"]["val_bpb"] = 0.5
    assert "signature does not verify" in authentic(result, KEY, RUN, SHA1)


def test_a_local_run_without_its_key_believes_nothing(tmp_path):
    backend = LocalBackend(tmp_path)
    assert backend._authentic(RUN, {"candidateSha1": SHA1}, signed(harness(), KEY)) \
        == "the run's key is missing"
