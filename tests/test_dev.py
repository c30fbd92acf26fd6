"""./dev's set-up: torch without CUDA on a machine without an NVIDIA GPU (issue 14, point 4)."""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import distributions
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
INSTALL = REPO / "tools" / "install-torch"


def fake_tools(tmp_path: Path, gpu: bool, has_cpu_wheel: bool) -> tuple[Path, Path]:
    """A bin/ with a pip that records its arguments (and nvidia-smi, if gpu)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "pip-calls"
    pip = bin_ / "pip"
    # Finds a +cpu wheel only from the CPU index, unless the machine has one at hand.
    found = "exit 0" if has_cpu_wheel else 'case "$*" in *--index-url*) exit 0;; *) exit 1;; esac'
    pip.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in *+cpu*) {found};; esac\nexit 0\n')
    pip.chmod(0o755)
    if gpu:
        smi = bin_ / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200'\n")
        smi.chmod(0o755)
    return pip, calls


def install(tmp_path: Path, gpu: bool, has_cpu_wheel: bool = False) -> list[str]:
    pip, calls = fake_tools(tmp_path, gpu, has_cpu_wheel)
    env = dict(os.environ, PATH=f"{pip.parent}:/usr/bin:/bin")
    subprocess.run([str(INSTALL), str(pip)], env=env, check=True, capture_output=True)
    return calls.read_text().splitlines()


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="the CUDA build is PyPI's Linux default")
def test_no_gpu_asks_for_the_cpu_build_and_never_plain_pypi_torch(tmp_path):
    calls = install(tmp_path, gpu=False)
    assert all("torch==2.13.0+cpu" in c for c in calls), calls
    assert "--index-url https://download.pytorch.org/whl/cpu" in calls[-1]


def test_a_cpu_wheel_at_hand_is_taken_without_the_network(tmp_path):
    assert install(tmp_path, gpu=False, has_cpu_wheel=True) == ["install -q torch==2.13.0+cpu"]


def test_a_machine_with_an_nvidia_gpu_gets_the_cuda_build(tmp_path):
    assert install(tmp_path, gpu=True) == ["install -q torch==2.13.0"]


def test_this_machines_environment_holds_no_cuda_wheels():
    """What ./dev built here: the CPU build of torch and not one nvidia-* package."""
    import torch

    if Path("/usr/bin/nvidia-smi").exists():
        pytest.skip("this machine has an NVIDIA GPU")
    assert torch.__version__.endswith("+cpu")
    names = sorted(d.metadata["Name"] for d in distributions())
    assert not [n for n in names if n.lower().startswith("nvidia")], names
