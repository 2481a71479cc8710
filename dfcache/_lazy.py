"""A module imported the first time one of its attributes is read.

numpy costs more to import (0.1 s and up on a busy machine) than a fully cached ``dfcache run``
spends on everything else (docs/benchmarks.md, ``noop-eval``), yet the store, the sample index
and the stages need it only to read, write or search arrays, which such a run never does. The
modules that hold those paths say ``np = LazyModule("numpy")`` instead of ``import numpy as
np``: their code reads the same, resolving keys and reading manifests imports no numpy, and the
first array operation imports it. ``'numpy' in sys.modules`` stays an honest answer (unlike
``importlib.util.LazyLoader``, which puts a placeholder there at once).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


class LazyModule:
    """Stands for the module ``name``; each attribute is looked up in it once, on first read,
    then kept on this object, so later reads cost what a module attribute costs."""

    def __init__(self, name: str) -> None:
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(import_module(self.__dict__["_lazy_name"]), attr)
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<lazily imported module {self.__dict__['_lazy_name']!r}>"
