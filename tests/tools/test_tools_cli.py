"""Every tool runs from the repository root as ``python -m tools.<name>`` (its --help, no GPU needed), and
tools/gpu_check.sh prints its help without building anything."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("module", ["cuda_error_probe", "cuda_memcheck_cases", "gpu_check_integration",
                                    "ncu_hotspots", "profile_ops", "provenance", "timeline_gaps"])
def test_every_tool_runs_from_the_repository_root(module):
    done = subprocess.run([sys.executable, "-m", f"tools.{module}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: ")


def test_gpu_check_prints_its_steps_and_refuses_unknown_options():
    done = subprocess.run(["bash", os.path.join("tools", "gpu_check.sh"), "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "python -m tools.cuda_error_probe" in done.stdout and "tools/cuda_memcheck_cases.py" in done.stdout
    assert "python -m benchmarks.decode_attention" in done.stdout
    done = subprocess.run(["bash", os.path.join("tools", "gpu_check.sh"), "--no-such-option"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "unknown option" in done.stdout
