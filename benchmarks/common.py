"""Helpers shared by the benchmark scripts: CUDA-graph timing, the GPU kind, and results files.

Timing: a benchmark step ``step(i)`` runs one layer's worth of work on layer buffer ``i``;
``time_graph`` captures the steps of all buffers in one CUDA graph and times its replays, so
launch gaps are those of a compiled model's graph, not of eager Python.

Results: every benchmark writes ``benchmarks/results/<benchmark>_<kind>.md`` and ``.json``, where
``kind`` names the device (``h100``, ``h200``, ``cpu``; see ``device_kind``). A new run replaces
both files; each records the date, device, library versions, code commit and the exact command
(``run_metadata``), so a results file says how to reproduce itself.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from tools import provenance

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results")

# ---- graph timing --------------------------------------------------------------------------------------

# A replay runs at least this many steps: the layers of one Llama-3.1-8B decode step. A graph replay
# has a fixed cost (~10 µs on an H100: an empty kernel measured 1.4 µs per step with 8 steps per replay
# and 5.1 µs with 2), which a model pays once per 32 layers; dividing it over fewer steps would charge
# every row a few µs a model never pays.
MIN_STEPS_PER_REPLAY = 32
# A replay of R steps that already takes this long keeps one pass over the buffers: the fixed cost is
# then under 1% of it, and 32 steps of the slowest rows would take minutes.
LONG_REPLAY_US = 2000.0
# Between two uses of one buffer, the other buffers' bytes of the step that reads least pass through
# L2 at least this many times over (so its data has left L2), and all the buffers hold 8 L2s.
L2_PASSES_BETWEEN_USES = 2
L2_MULTIPLE_IN_ALL = 8
MAX_LAYER_BUFFERS = 512

Step = Callable[[int], object]


def layer_buffers(layer_bytes_all: int, smallest_step_bytes: int, l2_bytes: int) -> int:
    """How many layers' buffers to rotate over (at least 2, at most MAX_LAYER_BUFFERS), so that no
    step finds in L2 what a model would read from DRAM.

    layer_bytes_all: every byte of one layer's inputs; smallest_step_bytes: what the step that reads
    least reads per layer; l2_bytes: the GPU's L2 size. Raises ValueError if any is not positive.
    """
    if layer_bytes_all <= 0 or smallest_step_bytes <= 0 or l2_bytes <= 0:
        raise ValueError("byte counts must be positive")
    in_all = math.ceil(L2_MULTIPLE_IN_ALL * l2_bytes / layer_bytes_all)
    between_uses = 1 + math.ceil(L2_PASSES_BETWEEN_USES * l2_bytes / smallest_step_bytes)
    return max(2, min(MAX_LAYER_BUFFERS, max(in_all, between_uses)))


def replay_cycles(layers: int, us_per_step: float) -> int:
    """Passes over the `layers` buffers per replay: enough for MIN_STEPS_PER_REPLAY steps, or one
    where a single pass already takes LONG_REPLAY_US."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if us_per_step * layers >= LONG_REPLAY_US:
        return 1
    return max(1, math.ceil(MIN_STEPS_PER_REPLAY / layers))


def time_graph(step: Step, layers: int, repeats: int, warmup: int, cycles: int = 1) -> float:
    """Median microseconds of one step, from replays of a graph running `step(i)` for i < layers,
    `cycles` times over (each replay's time is divided by layers * cycles). Needs a CUDA device."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture requires
        for i in range(layers):
            step(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(cycles):
            for i in range(layers):
                step(i)
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / (layers * cycles))
    del graph
    return statistics.median(times)


def time_steps(step: Step, layers: int, repeats: int, warmup: int) -> float:
    """time_graph with the passes per replay of replay_cycles, from a short first estimate."""
    estimate = time_graph(step, layers, 3, 1)
    return time_graph(step, layers, repeats, warmup, replay_cycles(layers, estimate))


# ---- device kind ---------------------------------------------------------------------------------------

def gpu_kind(name: str) -> str:
    """Short lower-case kind of a GPU for file names: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3"
    -> "h100"; a name without a model number like those becomes a slug of its words."""
    model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if model:
        return model.group(1).lower()
    words = re.findall(r"[a-z0-9]+", name.lower().replace("nvidia", ""))
    return "_".join(words) or "gpu"


def is_cuda(device: Optional[torch.device] = None) -> bool:
    """Whether ``device`` (default: the current device, if any) is a CUDA device."""
    return torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"


def device_kind(device: Optional[torch.device] = None) -> str:
    """``gpu_kind`` of a CUDA device (the current one by default), "cpu" for the CPU."""
    return gpu_kind(torch.cuda.get_device_name(device)) if is_cuda(device) else "cpu"


def device_name(device: Optional[torch.device] = None) -> str:
    """The GPU's name, or the CPU's with the threads torch uses."""
    if is_cuda(device):
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


# ---- results files -------------------------------------------------------------------------------------

# Environment variables that change what a run measures: the package's timing aids (for example
# HASHATTENTION_ENCODER), inductor's settings and the CUDA runtime's. Each run records the ones set.
MEASURED_ENVIRONMENT_PREFIXES = ("HASHATTENTION_", "TORCHINDUCTOR_")
MEASURED_ENVIRONMENT_NAMES = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING", "CUDA_LAUNCH_BLOCKING",
                              "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING")


def measured_environment() -> Dict[str, str]:
    """The set variables of MEASURED_ENVIRONMENT_PREFIXES / _NAMES, by name."""
    return {name: value for name, value in sorted(os.environ.items())
            if name.startswith(MEASURED_ENVIRONMENT_PREFIXES) or name in MEASURED_ENVIRONMENT_NAMES}


def results_paths(benchmark: str, kind: str, out_dir: Optional[str] = None) -> Tuple[str, str]:
    """(Markdown path, JSON path) of ``<out_dir>/<benchmark>_<kind>`` (default folder: benchmarks/results)."""
    stem = os.path.join(out_dir or RESULTS_DIR, f"{benchmark}_{kind}")
    return stem + ".md", stem + ".json"


def command_line(module: str, argv: Optional[Sequence[str]] = None) -> str:
    """How the run was started: ``python -m <module> <arguments>`` (sys.argv's by default)."""
    words = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python", "-m", module, *(shlex.quote(w) for w in words)])


def run_metadata(command: str, device: Optional[torch.device] = None) -> Dict[str, object]:
    """What a results file records about its run: date (UTC), device, versions, code and command."""
    return {"date": utc_now(), "device": device_name(device), **versions(), "code": provenance.describe(),
            "command": command, "environment": measured_environment()}


def utc_now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"


def versions() -> Dict[str, Optional[str]]:
    """torch, CUDA (None on a CPU-only build), transformers (None if not installed) and Python versions."""
    try:
        import transformers

        transformers_version = transformers.__version__
    except ImportError:
        transformers_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers_version,
            "python": platform.python_version()}


def header_lines(meta: Dict[str, object]) -> List[str]:
    """The Markdown bullet lines that open every results file, from ``run_metadata``'s dict."""
    versions = [f"torch {meta['torch']}", f"CUDA {meta['cuda']}"]
    for name, label in (("transformers", "transformers"), ("python", "Python")):
        if meta.get(name):  # None where the library is missing (or a run did not record it)
            versions.append(f"{label} {meta[name]}")
    lines = [f"- date: {meta['date']}",
             f"- device: {meta['device']}; " + ", ".join(versions),
             f"- code: {provenance.label(meta['code'])}",
             f"- command: `{meta['command']}`"]
    if meta.get("environment"):
        lines.append("- environment: `" + " ".join(f"{k}={v}" for k, v in meta["environment"].items()) + "`")
    return lines


def write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically (a run killed mid-write leaves the old file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    os.replace(tmp, path)


def write_results(md_path: str, json_path: str, markdown: str, record: dict) -> None:
    """Replace the Markdown and JSON results files of a run."""
    write_text(json_path, json.dumps(record, indent=1))
    write_text(md_path, markdown)


def render_markdown(json_path: str, markdown: Callable[[dict], str]) -> dict:
    """Rewrite the Markdown beside a results JSON (``<name>.md``) from its record, measuring nothing."""
    with open(json_path) as f:
        record = json.load(f)
    write_text(os.path.splitext(json_path)[0] + ".md", markdown(record))
    return record
