"""Atomic file writes and resumable per-layer training checkpoints.

A checkpoint is written to a temporary file in the same directory and renamed over the old one, so
a crash at any moment leaves either the previous or the new checkpoint, never a torn file. It holds
plain tensors and numbers only and is read back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any, Callable, Dict, Optional

import torch


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp_path)`` then rename ``tmp_path`` to ``path``."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix="-" + os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    atomic_write(path, lambda p: torch.save(state, p))


def load_checkpoint(path: str) -> Optional[Dict[str, Any]]:
    """The checkpoint at ``path``, or None when there is none; a file that cannot be read is a
    ValueError naming it (torch's own message does not)."""
    if not os.path.exists(path):
        return None
    with naming_the_file(path, "checkpoint", "delete it to start this layer again"):
        return torch.load(path, map_location="cpu", weights_only=True)


@contextlib.contextmanager
def naming_the_file(path: str, what: str, remedy: str = ""):
    """Re-raise an error of reading ``path`` as a ValueError that names the file: torch's and
    safetensors' messages ("PytorchStreamReader failed reading zip archive", "Error while
    deserializing header") do not say which file is damaged."""
    try:
        yield
    except Exception as error:
        hint = f"; {remedy}" if remedy else ""
        raise ValueError(f"cannot read {what} {path}: {type(error).__name__}: {error}{hint}") from error
