"""Loads the compiled extension, which registers ``torch.ops.hashattention.*`` on import."""

from __future__ import annotations

import importlib

_BUILD_HINT = (
    "hashattention's compiled extension (hashattention._C) could not be loaded. Build it from the "
    "repository root with `pip install --no-build-isolation -e .` (or run `make test`, which sets "
    "everything up), using the same torch that imports it."
)


def load_extension():
    """Import ``hashattention._C`` (registering the ops) or raise an ImportError that says how to build it."""
    try:
        return importlib.import_module("hashattention._C")
    except ImportError as error:  # missing .so, or built against another torch (undefined symbols)
        raise ImportError(f"{_BUILD_HINT}\nUnderlying error: {error}") from error
