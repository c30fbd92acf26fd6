"""The result contract: when the controller believes a run's result.

The harness (bench/run.py, or bench/hf_entry.py on a Hugging Face job) signs its result with
HMAC-SHA256 under a key made for that run, which the candidate never sees. Whatever carried
the result (a file in the run's directory, a Pod's termination message, a job's log), the
controller believes it only if all of these hold, and otherwise says which failed:

1. the signature verifies under this run's key (a candidate cannot forge one);
2. it names this run (a result signed for another run is not replayed into this one);
3. it measured the candidate this run was asked to run (`candidate_sha1`): a succeeded result
   must name it; any other may leave it out (a harness that could not even read the candidate
   reports an error without one), but never name another program.

Every backend asks `authentic` (or, where the transport signs an envelope instead of the
result, `wrong_candidate` for the third rule); there is one answer to "is this the harness's?".
"""

from __future__ import annotations

import hashlib
import hmac
import json


def result_signature(key: bytes, result: dict) -> str:
    """HMAC-SHA256 over the result without its signature (bench/harness_result.py's `signature`)."""
    body = {k: v for k, v in result.items() if k != "signature"}
    return hmac.new(key, json.dumps(body, sort_keys=True, separators=(",", ":")).encode(),
                    hashlib.sha256).hexdigest()


def wrong_candidate(result: dict, candidate_sha1: str | None) -> str | None:
    """None if `result` measured the candidate with `candidate_sha1` (rule 3); else what is
    wrong with it."""
    measured = result.get("candidate_sha1")
    if candidate_sha1 and measured not in (None, candidate_sha1):
        return "it measured another program than the one this run was asked to run"
    if result.get("status") == "succeeded" and measured != candidate_sha1:
        return "it does not name the candidate it measured"
    return None


def authentic(result: dict, key: bytes, run: str, candidate_sha1: str | None) -> str | None:
    """None if `result` is this run's harness's (signed with its key, naming it and the
    candidate it was asked to measure); else what is wrong with it."""
    sig = result.get("signature")
    if not isinstance(sig, str) or not hmac.compare_digest(sig, result_signature(key, result)):
        return "its signature does not verify under this run's key"
    if result.get("run") != run:
        return f"it names the run {result.get('run')!r}"
    return wrong_candidate(result, candidate_sha1)
