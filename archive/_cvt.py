"""A MAP-Elites archive whose cells are the Voronoi regions of centroids (CVT-MAP-Elites).

Distances are measured with every descriptor scaled to [0, 1] over its range, so descriptors in
different units weigh the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from archive._base import Archive

__all__ = ["CVTArchive"]

_LLOYD_ITERATIONS = 20


class CVTArchive(Archive):
    """``cells`` centroids from k-means over ``samples`` uniform points in ``ranges`` (seeded).

    The centroids are computed once; :attr:`centroids` (in descriptor units) and :meth:`layout` let a
    run store them and pass them back on resume, so cells never move. A descriptor vector belongs to
    its nearest centroid (after clipping into ``ranges``).
    """

    kind = "cvt"

    def __init__(
        self,
        *,
        names: Sequence[str],
        ranges: Sequence[tuple[float, float]],
        cells: int,
        samples: int = 10_000,
        seed: int,
        centroids: np.ndarray | Sequence[Sequence[float]] | None = None,
    ) -> None:
        super().__init__(names=names, ranges=ranges)
        if cells < 1:
            raise ValueError(f"cells must be >= 1, got {cells}")
        span = self._upper - self._lower
        if centroids is None:
            if samples < cells:
                raise ValueError(f"samples ({samples}) must be >= cells ({cells})")
            unit = _kmeans(cells=cells, samples=samples, dims=len(self.names), rng=np.random.default_rng(seed))
            centroids = self._lower + unit * span
        c = np.array(centroids, dtype=float)
        if c.shape != (cells, len(self.names)) or not np.isfinite(c).all():
            raise ValueError(f"centroids must be a finite array of shape ({cells}, {len(self.names)}), got {c.shape}")
        self._cells, self.samples, self.seed = int(cells), int(samples), int(seed)
        self.centroids: np.ndarray = c
        self.centroids.flags.writeable = False
        from scipy.spatial import cKDTree  # here: scipy's import costs every evo command 0.3 s

        self._tree = cKDTree((c - self._lower) / span)  # a fresh and a restored archive share this path

    @property
    def cells(self) -> int:
        return self._cells

    def _index(self, x: np.ndarray) -> int:
        return int(self._tree.query((x - self._lower) / (self._upper - self._lower))[1])

    def _layout(self) -> dict[str, Any]:
        return {"cells": self._cells, "samples": self.samples, "seed": self.seed, "centroids": self.centroids.tolist()}


def _kmeans(*, cells: int, samples: int, dims: int, rng: np.random.Generator) -> np.ndarray:
    """Lloyd's k-means in the unit cube, started from distinct random samples; empty clusters stay put."""
    x = rng.random((samples, dims))
    c = x[rng.choice(samples, size=cells, replace=False)].copy()
    from scipy.spatial import cKDTree

    for _ in range(_LLOYD_ITERATIONS):
        label = cKDTree(c).query(x)[1]
        counts = np.bincount(label, minlength=cells)
        sums = np.stack([np.bincount(label, weights=x[:, d], minlength=cells) for d in range(dims)], axis=1)
        filled = counts > 0
        c[filled] = sums[filled] / counts[filled, None]
    return c
