"""Every ```python and ```bash block of README.md and docs/*.md runs, so a documented example cannot rot.

Each block runs in a fresh process: a python block as a script in a temporary directory (the
installed package, the offline SmolLM2 model and the shipped adapters are all it may rely on), a
bash block with ``bash -e`` at the repository root (where ``python -m train``, ``benchmarks`` and
``tools`` run), with the test environment's ``python`` first on ``PATH``.

A block that must not run here carries a marker on the line right above its opening fence; the
marker is the only way to leave a block out:

* ``<!-- snippet: skip -->``: not meant to run in tests (installs, builds, the whole test suite,
  GPU benchmarks, hour-long training, commands with placeholders such as ``/path/to/model``);
* ``<!-- snippet: cuda -->``: needs a CUDA device; runs where one is present, skipped elsewhere.

Blocks in other languages (``bibtex``, directory trees without a language) are text, never run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = ("python", "bash")
MARKERS = ("skip", "cuda")
MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<kind>\S+)\s*-->$")
FENCE = re.compile(r"^```(?P<language>\S*)\s*$")
TIMEOUT_S = 600


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    marker: Optional[str]

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> List[Block]:
    """The fenced blocks of ``page`` with the snippet marker directly above each (None without one)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, index = [], 0
    while index < len(lines):
        fence = FENCE.match(lines[index])
        if fence is None:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        assert end < len(lines), f"{page}:{index + 1}: unterminated code block"
        above = MARKER.match(lines[index - 1].strip()) if index > 0 else None
        blocks.append(Block(page, index + 1, fence["language"], "\n".join(lines[index + 1:end]) + "\n",
                            above["kind"] if above else None))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in code_blocks(page)]
RUNNABLE = [block for block in BLOCKS if block.language in RUN_LANGUAGES]


def test_pages_have_runnable_blocks():
    assert len(RUNNABLE) >= 10, [block.name for block in RUNNABLE]


def test_markers_are_known_and_sit_on_a_block():
    """A misspelt marker or one that drifted away from its block would silently run or skip the wrong thing."""
    marked_lines = {(block.page, block.line - 1) for block in BLOCKS if block.marker}
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if not (line.strip().startswith("<!--") and "snippet" in line):
                continue
            match = MARKER.match(line.strip())
            assert match and match["kind"] in MARKERS, f"{page.name}:{number}: unknown snippet marker {line!r}"
            assert (page, number) in marked_lines, f"{page.name}:{number}: marker not directly above a code block"
    for block in BLOCKS:
        if block.marker:
            assert block.language in RUN_LANGUAGES, f"{block.name}: marker on a ```{block.language} block"


def environment() -> dict:
    """The test environment's, offline, with its ``python`` first on ``PATH`` and one intra-op thread.

    One thread: SmolLM2's batch-of-2 decode GEMMs took 16 ms each with torch's two OpenMP threads on
    a busy 2-core machine (the threads wait for each other) against 0.14 ms with one, which made the
    batched example 10x slower; one thread keeps every snippet's time steady.
    """
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[block.name for block in RUNNABLE])
def test_snippet_runs(block: Block, tmp_path):
    if block.marker == "skip":
        pytest.skip("marked <!-- snippet: skip -->")
    if block.marker == "cuda" and not torch.cuda.is_available():
        pytest.skip("marked <!-- snippet: cuda -->; no CUDA device")
    if block.language == "python":
        script = tmp_path / "snippet.py"
        script.write_text(block.code)
        command, cwd = [sys.executable, str(script)], tmp_path
    else:
        command, cwd = ["bash", "-e", "-o", "pipefail", "-c", block.code], ROOT
    result = subprocess.run(command, cwd=cwd, env=environment(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (
        f"{block.name} failed (exit {result.returncode}):\n{block.code}\n--- stdout\n{result.stdout[-3000:]}"
        f"\n--- stderr\n{result.stderr[-6000:]}"
    )
