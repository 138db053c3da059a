"""A MAP-Elites archive whose cells are a regular grid over fixed descriptor ranges."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from archive._base import Archive

__all__ = ["GridArchive"]


class GridArchive(Archive):
    """``bins[i]`` equal-width bins over ``ranges[i]`` per descriptor; cells numbered row-major.

    Ranges never shift. A value on an interior boundary belongs to the upper bin, the upper end of a
    range to the last bin; values outside a range fall in the edge bins (clipped).
    """

    kind = "grid"

    def __init__(self, *, names: Sequence[str], bins: Sequence[int], ranges: Sequence[tuple[float, float]]) -> None:
        super().__init__(names=names, ranges=ranges)
        if len(bins) != len(self.names):
            raise ValueError(f"{len(self.names)} descriptor names but {len(bins)} bin counts")
        if any(int(b) != b or b < 1 for b in bins):
            raise ValueError(f"bins must be positive integers, got {list(bins)}")
        self.bins: tuple[int, ...] = tuple(int(b) for b in bins)
        self._inner = [np.linspace(lo, hi, b + 1)[1:-1] for (lo, hi), b in zip(self.ranges, self.bins, strict=True)]

    @property
    def cells(self) -> int:
        return math.prod(self.bins)

    def boundaries(self) -> list[np.ndarray]:
        """Per descriptor, the ``bins + 1`` bin edges."""
        return [np.linspace(lo, hi, b + 1) for (lo, hi), b in zip(self.ranges, self.bins, strict=True)]

    def grid_index(self, cell: int) -> tuple[int, ...]:
        """The per-descriptor bin indices of a cell."""
        return tuple(int(i) for i in np.unravel_index(cell, self.bins))

    def _index(self, x: np.ndarray) -> int:
        idx = [int(np.searchsorted(inner, v, side="right")) for inner, v in zip(self._inner, x, strict=True)]
        return int(np.ravel_multi_index(idx, self.bins))

    def _layout(self) -> dict[str, Any]:
        return {"bins": list(self.bins)}
