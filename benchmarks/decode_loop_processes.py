"""``benchmarks.decode_loop --process-per-method``: every method timed in a Python process of its own.

Why: what ran earlier in a process changes how fast its CUDA-graph replays run. On an H200 (torch
2.11, CUDA 13.0) a B = 4 / 128K per-query-head decode step took 8.56-8.58 ms in processes that never
used cuDNN and 8.86 ms in processes where one cuDNN call (SDPA through cuDNN, or a convolution) or a
cold inductor compile came first: the same kernels, with ~0.3 ms more GPU idle time between graph
nodes. The dense rows need cuDNN (its SDPA backend is the fastest that passes the check),
HashAttention's decode does not, so in one shared process the dense checks slow every later
HashAttention row. One process per method measures each method as a user running only that model
gets it; ``--warm-compile`` first runs each method once, untimed and in its own process, so that the
timed process finds a warm compile cache (a server's usual state after its first start).

The first timed process starts the ``--out`` files (unless the parent was given ``--merge``), the
later ones merge their rows into them, in the order of ``--methods``; rows of a method measured
before dense get their ratio when the dense row arrives. Children run as ``python -m
benchmarks.decode_loop`` in the parent's working directory and environment.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from typing import List

MODULE = "benchmarks.decode_loop"
# Options of the parent only: the children get --methods, --out and --merge from it.
PARENT_FLAGS = ("--process-per-method", "--warm-compile", "--merge")


def child_argv(argv: List[str]) -> List[str]:
    """The parent's arguments without its own flags (later --methods / --out options override the rest)."""
    return [word for word in argv if word not in PARENT_FLAGS]


def run_child(arguments: List[str], label: str) -> int:
    command = [sys.executable, "-m", MODULE, *arguments]
    print(f"[process per method] {label}: {' '.join(command[2:])}", flush=True)
    return subprocess.call(command)


def run_in_processes(args, argv: List[str]) -> int:
    """Runs every method of ``args`` in its own child process; returns how many children failed."""
    started = time.monotonic()
    base = child_argv(list(argv))
    failures = 0
    # The warm-up runs' rows are thrown away with this folder.
    with tempfile.TemporaryDirectory(prefix="decode_loop_warm_") as warm_out:
        for index, method in enumerate(args.method_specs):
            if not run_method_process(args, base, method, index, warm_out if args.warm_compile else None, started):
                failures += 1
    return failures


def run_method_process(args, base: List[str], method, index: int, warm_out, started: float) -> bool:
    """The optional warm-up child (when ``warm_out`` is a folder), then the timed child of one method;
    False when the timed child failed or the time budget was spent before it."""
    remaining = args.time_budget_s - (time.monotonic() - started)
    if remaining <= 0:
        print(f"[process per method] time budget spent before {method.name}", flush=True)
        return False
    if warm_out is not None and args.compile != "none":  # "none" compiles nothing
        code = run_child([*base, "--methods", method.name, "--out", warm_out, "--profile-steps", "0",
                          "--paced-steps", "0", "--no-attention-share", "--trace-dir", "",
                          "--time-budget-s", f"{remaining:.0f}"], f"{method.name}, compile-cache warm-up")
        if code != 0:
            print(f"[process per method] warm-up of {method.name} exited with {code}", flush=True)
        remaining = args.time_budget_s - (time.monotonic() - started)
    merge = ["--merge"] if args.merge or index > 0 else []
    code = run_child([*base, *merge, "--methods", method.name, "--time-budget-s", f"{max(remaining, 1):.0f}"],
                     method.name)
    if code != 0:
        print(f"[process per method] {method.name} exited with {code}", flush=True)
    return code == 0
