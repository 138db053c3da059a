"""Executors: where evaluations run, all behind one protocol (:mod:`runtime.executors.base`).

| executor | module | runs requests |
| --- | --- | --- |
| :class:`LocalPool` | :mod:`runtime.executors.local` | in sandboxed worker processes on this machine (the default) |
| :class:`RayPool` | :mod:`runtime.executors.ray` | on every node of a Ray cluster, a local pool on each |

A caller uses only what :class:`Executor` declares: ``submit``, ``next_result``, ``in_flight``, ``slots``,
``close``, and ``with``. A run takes a :class:`RayPool` with ``execution.kind: ray``; Ray itself is imported
only when one starts.
"""

from __future__ import annotations

from runtime.executors.base import EvalRequest, Executor
from runtime.executors.local import LocalPool, PoolEvent
from runtime.executors.ray import ClusterUnavailable, MixedHardware, RayPool

__all__ = ["ClusterUnavailable", "EvalRequest", "Executor", "LocalPool", "MixedHardware", "PoolEvent", "RayPool"]
