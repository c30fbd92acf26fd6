"""What a candidate writes must never become the harness's fault, nor the harness's memory.

A run whose result is `error` measured nothing: the candidate is not a Duplicate and may run
again, and a confirm run that ends in `error` ends its experiment NotConfirmed without counting
as a confirm try. So a candidate that could turn a run into `error` at will, once it has
trained and can judge its own luck (its training loss, a held-out slice of the training
stream), could void every unlucky draw and keep the lucky ones. Three ways it could:

* curve.jsonl with an integer too large for a float: math.isfinite raised OverflowError in
  run.py's _curve (a harness error before the evaluation);
* stats.json nested thousands deep: json.loads raised RecursionError, which _json_object did not
  catch (ValueError only), and stats.json with such an integer (OverflowError in _number);
* on a machine without a GPU, an export whose weights claim a CUDA device: the evaluator blamed
  itself ("exported on a GPU but the evaluator has none").

And one line of output without a newline was read whole by the harness's readline(): the root
harness grew by twice the line's size, without bound (1 GiB of output: 2.1 GB).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
TRAIN = BENCH / "train.py"
EXPORT = "\nif prepare.export_model(raw_model, stats) is not None:"


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    cache = tmp_path_factory.mktemp("blame-cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("AUTOLAB_CACHE", str(cache))
    mp.setenv("AUTOLAB_BENCH_PROFILE", "tiny")
    for var in ("AUTOLAB_SOURCE", "AUTOLAB_DATA_DIR", "AUTOLAB_TIME_BUDGET", "AUTOLAB_SANDBOX_UID"):
        mp.delenv(var, raising=False)
    mp.syspath_prepend(str(BENCH))
    if "prepare" in sys.modules:
        importlib.reload(sys.modules["prepare"])
    spec = importlib.util.spec_from_file_location("autolab_run_blame", BENCH / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    yield types.SimpleNamespace(run=run, cache=cache)
    mp.undo()


def _run(bench, tmp: Path, candidate: Path, rss: bool = False) -> tuple[dict, int | None]:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "LD_LIBRARY_PATH")}
    env.update(AUTOLAB_CACHE=str(bench.cache), AUTOLAB_BENCH_PROFILE="tiny", CUDA_VISIBLE_DEVICES="")
    mode = "bwrap" if bench.run.sandbox.available() is None else "none"
    argv = [sys.executable, "-I", str(BENCH / "run.py"), "--candidate", str(candidate),
            "--result", str(tmp / "result.json"), "--source", "synthetic", "--budget", "2.5",
            "--sandbox", mode, "--termination-log", str(tmp / "term")]
    if rss:  # the peak RSS of the harness, measured in a process of its own
        argv = [sys.executable, "-c", "import resource, subprocess, sys; "
                "subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)", *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    peak = int(done.stdout.split()[-1]) * 1024 if rss else None
    return json.loads((tmp / "result.json").read_text()), peak


def _candidate(tmp: Path, code: str) -> Path:
    src = TRAIN.read_text()
    assert EXPORT in src
    path = tmp / "candidate" / "train.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(src.replace(EXPORT, code + EXPORT))
    return path


def test_hostile_numbers_and_nesting_in_candidate_files_raise_nothing(bench):
    run = bench.run
    huge = 10 ** 400
    assert run._number(huge) is None and run._number(-huge) is None and run._number(3) == 3
    assert run._json_object(b"[" * 30000 + b"]" * 30000) == {}
    assert run._json_object(b'{"a": ' * 30000 + b"1" + b"}" * 30000) == {}
    line = json.dumps({"step": 10, "loss": 1.0, "tokens_per_sec": 5.0})
    raw = "\n".join([line, '{"step": 1%s, "loss": 1, "tokens_per_sec": 1}' % ("0" * 400),
                     "[" * 30000, '{"step": 1, "loss": 1, "tokens_per_sec": 1, "time": 1%s}' % ("0" * 400)])
    assert run._curve(raw.encode()) == [json.loads(line), {"step": 1, "loss": 1, "tokens_per_sec": 1}]
    metrics = run._metrics({"peak_vram_mb": huge, "num_steps": huge, "mfu_percent": [huge]},
                           {"val_bpb": 1.0, "num_params": 10}, training=1.0, total=2.0, tokens=3)
    assert metrics["peak_vram_mb"] is None and metrics["num_steps"] is None


@pytest.mark.parametrize("attack", ["curve-bigint", "stats-nested", "stats-bigint", "cuda-device"])
def test_a_candidate_cannot_turn_its_run_into_a_harness_error(bench, tmp_path, attack):
    code = {
        "curve-bigint": '''
import os as _os
with open(_os.environ["AUTOLAB_CURVE_PATH"], "a") as _f:
    _f.write('{"step": 1%s, "loss": 1.0, "tokens_per_sec": 1.0}\\n' % ("0" * 400))
''',
        "stats-nested": '''
_orig_export = prepare.export_model
def _export(model_, stats_, *a, **k):
    out = _orig_export(model_, stats_, *a, **k)
    if out is not None:
        (out / "stats.json").write_text("[" * 30000 + "]" * 30000)
    return out
prepare.export_model = _export
''',
        "stats-bigint": '''
stats["peak_vram_mb"] = 10 ** 400
''',
        "cuda-device": '''
import json as _json, zipfile as _zipfile, os as _os
_orig_export = prepare.export_model
def _export(model_, stats_, *a, **k):
    out = _orig_export(model_, stats_, *a, **k)
    if out is None:
        return out
    src, tmp = out / "model.pt2", out / "m.tmp"
    with _zipfile.ZipFile(src) as zin, _zipfile.ZipFile(tmp, "w", _zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("model_weights_config.json"):
                doc = _json.loads(data)
                next(iter(doc["config"].values()))["tensor_meta"]["device"] = {"type": "cuda", "index": 0}
                data = _json.dumps(doc).encode()
            zout.writestr(info.filename, data)
    _os.replace(tmp, src)
    return out
prepare.export_model = _export
''',
    }[attack]
    result, _ = _run(bench, tmp_path, _candidate(tmp_path, code))
    assert result["status"] != "error", result["reason"]
    if attack == "cuda-device":
        assert (result["status"], result["reason_code"]) == ("failed", "ExportRefused"), result
    else:  # informational files: the junk is dropped, the model is measured
        assert result["status"] == "succeeded", result["reason"]


def test_output_without_newlines_does_not_grow_the_harness(bench, tmp_path):
    mib = 256
    candidate = tmp_path / "candidate" / "train.py"
    candidate.parent.mkdir(parents=True)
    candidate.write_text(f"import os\nfor _ in range({mib}):\n    os.write(1, b'A' * 2**20)\n"
                         "os.write(1, b'\\nend\\n')\n")
    result, peak = _run(bench, tmp_path, candidate, rss=True)
    assert result["reason_code"] == "NoTraining"
    assert peak < 150 * 2**20, f"the harness peaked at {peak / 2**20:.0f} MiB for {mib} MiB of one line"
