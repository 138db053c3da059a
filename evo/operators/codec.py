"""A typed codec between parameter dicts and the flat gene lists DEAP's operators work on.

Discrete genes (int, pow2, choice) are encoded as indices into their domain's values, floats as
themselves, so DEAP's numeric operators see one ordered axis per parameter.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from genome import ChoiceParam, FloatParam, ParamSpace

__all__ = ["GeneCodec", "seeded_random"]


class GeneCodec:
    def __init__(self, space: ParamSpace) -> None:
        self.space = space
        self.names = space.names()
        self.domains = [space.params[n] for n in self.names]

    def encode(self, params: Mapping[str, Any]) -> list[float]:
        genes: list[float] = []
        for name, dom in zip(self.names, self.domains, strict=True):
            v = dom.snap(params[name]) if name in params else dom.values()[0] if dom.discrete else dom.low
            genes.append(float(v) if isinstance(dom, FloatParam) else float(dom.index(v)))
        return genes

    def decode(self, genes: list[float]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, dom, g in zip(self.names, self.domains, genes, strict=True):
            if isinstance(dom, FloatParam):
                out[name] = dom.snap(g)
            else:
                vals = dom.values()
                out[name] = vals[min(max(int(round(g)), 0), len(vals) - 1)]
        return out

    def upper_index(self, i: int) -> int:
        return len(self.domains[i].values()) - 1

    def is_choice(self, i: int) -> bool:
        return isinstance(self.domains[i], ChoiceParam)

    def is_float(self, i: int) -> bool:
        return isinstance(self.domains[i], FloatParam)


@contextmanager
def seeded_random(rng: np.random.Generator) -> Iterator[None]:
    """Runs a block with the global ``random`` seeded from ``rng``, restoring its previous state after.

    DEAP's operators draw from the global ``random``; this keeps proposals reproducible from
    (run seed, proposal counter) without leaking state between proposals or into user code.
    """
    saved = random.getstate()
    random.seed(int(rng.integers(2**63)))
    try:
        yield
    finally:
        random.setstate(saved)
