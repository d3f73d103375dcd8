"""Local text corpora: which files a corpus holds, and the held-out split shared by training and evaluation.

A corpus is a folder of ``*.txt`` files, searched recursively (``README.txt`` files are skipped). A file
is *held out* iff ``crc32(relative path) % modulus == 0``, with the path written with ``/`` on every
platform. The adapter training validates on the held-out files, and the evaluation measures on them,
so with the same modulus (10 by default in both) the evaluation text was never seen in training. The
rule depends only on a file's own path, never on how many files there are or in which order they are read.
"""

from __future__ import annotations

import os
import zlib
from typing import List


def corpus_files(corpus: str) -> List[str]:
    """Sorted ``/``-separated paths, relative to ``corpus``, of its ``*.txt`` files (README files excluded).

    Raises a ValueError when ``corpus`` is not a directory or holds no such file.
    """
    if not os.path.isdir(corpus):
        raise ValueError(f"corpus must be a directory of .txt files, got {corpus!r}")
    found = []
    for root, _, names in os.walk(corpus):
        for name in names:
            if name.endswith(".txt") and name.lower() != "readme.txt":
                found.append(os.path.relpath(os.path.join(root, name), corpus).replace(os.sep, "/"))
    if not found:
        raise ValueError(f"corpus {corpus!r} holds no .txt files")
    return sorted(found)


def path_checksum(relative_path: str) -> int:
    """crc32 of the ``/``-separated relative path: the split's key, and the training's reading order."""
    return zlib.crc32(relative_path.replace(os.sep, "/").encode())


def is_held_out(relative_path: str, modulus: int) -> bool:
    """Whether the file at ``relative_path`` belongs to the held-out split (``modulus`` >= 1)."""
    if modulus < 1:
        raise ValueError(f"modulus must be >= 1, got {modulus}")
    return path_checksum(relative_path) % modulus == 0
