"""benchmarks.common's results files (names, provenance header, replacement) and the CPU benchmark that
writes one (benchmarks.ops_cpu), plus the command-line help of every benchmark module."""

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import common

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("name, kind", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA L40S", "l40s"),
    ("NVIDIA GeForce RTX 4090", "geforce_rtx_4090"),
])
def test_gpu_kind_names_the_model(name, kind):
    assert common.gpu_kind(name) == kind


def test_cpu_device_kind_and_name():
    assert common.device_kind(torch.device("cpu")) == "cpu"
    assert common.device_name(torch.device("cpu")).startswith("CPU (")


def test_results_paths_have_no_date_and_default_to_the_results_folder(tmp_path):
    md, js = common.results_paths("decode_attention", "h200")
    assert md == os.path.join(ROOT, "benchmarks", "results", "decode_attention_h200.md")
    assert js == md[:-3] + ".json"
    assert common.results_paths("ops", "cpu", str(tmp_path)) == (str(tmp_path / "ops_cpu.md"),
                                                                 str(tmp_path / "ops_cpu.json"))


def test_metadata_header_records_versions_code_command_and_set_knobs(monkeypatch):
    for name in common.measured_environment():  # the test suite's own (HASHATTENTION_POISON_OUTPUTS)
        monkeypatch.delenv(name)
    monkeypatch.setenv("HASHATTENTION_ENCODER", "fma")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    command = common.command_line("benchmarks.encoder", ["--batches", "1", "4", "--out", "/tmp/a b"])
    assert command == "python -m benchmarks.encoder --batches 1 4 --out '/tmp/a b'"
    meta = common.run_metadata(command, torch.device("cpu"))
    assert meta["torch"] == torch.__version__ and meta["command"] == command
    assert meta["environment"] == {"HASHATTENTION_ENCODER": "fma"}
    assert set(meta["code"]) == {"git_commit", "git_dirty", "source_sha256"}
    lines = common.header_lines(meta)
    assert lines[0].startswith("- date: ") and lines[0].endswith(" UTC")
    assert lines[1].startswith("- device: CPU (") and f"torch {torch.__version__}" in lines[1]
    assert lines[2].startswith("- code: commit ")
    assert lines[3] == f"- command: `{command}`"
    assert lines[4] == "- environment: `HASHATTENTION_ENCODER=fma`"


def test_a_new_run_replaces_the_results_files(tmp_path):
    md, js = common.results_paths("encoder", "h100", str(tmp_path / "new"))
    common.write_results(md, js, "# first\n", {"rows": [1, 2]})
    common.write_results(md, js, "# second", {"rows": [3]})
    assert open(md).read() == "# second\n"
    assert json.load(open(js)) == {"rows": [3]}
    assert sorted(os.listdir(tmp_path / "new")) == ["encoder_h100.json", "encoder_h100.md"]


def test_ops_cpu_writes_its_results_file(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.ops_cpu", "--keys", "2048", "--repeats", "1",
                           "--threads", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    record = json.load(open(tmp_path / "ops_cpu.json"))
    assert [r["op"] for r in record["rows"]][:3] == ["encode_signatures (all N keys)", "hamming_scores",
                                                     "hamming_topk"]
    assert all(r["ours_ms"] > 0 and r["reference_ms"] > 0 for r in record["rows"])
    assert record["meta"]["command"] == (f"python -m benchmarks.ops_cpu --keys 2048 --repeats 1 --threads 1 "
                                         f"--out {tmp_path}")
    text = open(tmp_path / "ops_cpu.md").read()
    assert text.startswith("# CPU kernels against the plain-PyTorch reference (CPU (")
    assert "| hamming_topk | " in text and "N = 2048, Hq = 8, Hkv = 2" in text


@pytest.mark.parametrize("module", ["decode_attention", "decode_loop", "encoder", "ops_cpu"])
def test_every_benchmark_runs_from_the_repository_root(module):
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: ")
