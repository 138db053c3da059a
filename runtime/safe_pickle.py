"""Unpickling what a worker answers, with only the classes an answer is made of.

A worker never runs candidate code, and no candidate's process holds its channel to the controller.
Should either ever fail, a pickle that names any other class (``os.system``, ``builtins.eval``, a
module's function) is refused here instead of being called in the controller.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["ALLOWED", "UnsafePickle", "loads"]

ALLOWED: frozenset[tuple[str, str]] = frozenset({
    ("runtime.result", "EvalResult"), ("runtime.result", "Status"), ("runtime.result", "TimingStats"),
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy._core.numeric", "_frombuffer"), ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"), ("numpy.core.multiarray", "scalar"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "complex"),
    ("collections", "OrderedDict"),
})  # fmt: skip
"""``(module, name)`` of every global an answer may name: results, statuses, numpy arrays and scalars."""


class UnsafePickle(pickle.UnpicklingError):
    """A pickle named a global outside :data:`ALLOWED`."""


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED:
            raise UnsafePickle(f"refused to unpickle {module}.{name}: not part of an evaluation's answer")
        return super().find_class(module, name)


def loads(data: bytes) -> Any:
    """``pickle.loads`` restricted to :data:`ALLOWED`; :class:`UnsafePickle` for anything else."""
    return _Restricted(io.BytesIO(data)).load()
