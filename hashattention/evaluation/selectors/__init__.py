"""Selector registry: every :class:`~.base.Selector` subclass with a ``name`` in this package.

Adding a selector is adding one file here that defines such a class; :func:`selector_names`
imports every module of the package and lists ``name + suffix`` for each entry of the class's
``variants`` (``lsh-32``, ``lsh-256``, ...). The order is the evaluation order: ``full``
first (the reference row), then the oracle, then the others alphabetically (numbers in numeric order).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from typing import Dict, List, Tuple, Type

from .base import Budget, ModelShape, Selector, SelectorSetup, SelectorUnavailable

_FIRST = ("full", "oracle")


def _discover() -> Dict[str, Tuple[Type[Selector], dict]]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: Dict[str, Tuple[Type[Selector], dict]] = {}
    pending = list(Selector.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if not cls.name:
            continue
        for suffix, options in cls.variants.items():
            full_name = cls.name + suffix
            if full_name in found and found[full_name][0] is not cls:
                raise RuntimeError(f"two selectors are named {full_name!r}: {found[full_name][0]} and {cls}")
            found[full_name] = (cls, dict(options))
    return found


def selector_names() -> List[str]:
    """Every registered selector name, in evaluation order."""
    names = list(_discover())
    first = [n for n in _FIRST if n in names]
    natural = lambda n: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", n)]  # lsh-32 before lsh-256
    return first + sorted((n for n in names if n not in _FIRST), key=natural)


def create_selector(name: str) -> Selector:
    """A fresh instance of the selector registered as ``name``."""
    registry = _discover()
    if name not in registry:
        raise ValueError(f"unknown selector {name!r}; registered: {', '.join(selector_names())}")
    cls, options = registry[name]
    selector = cls(**options)
    selector.registered_name = name
    return selector


__all__ = [
    "Budget",
    "ModelShape",
    "Selector",
    "SelectorSetup",
    "SelectorUnavailable",
    "create_selector",
    "selector_names",
]
