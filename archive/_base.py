"""What MAP-Elites archives share: the add rule, elites, sampling, QD statistics and layouts.

An archive maps a candidate's descriptors to one cell and keeps the fittest candidate per cell.
Subclasses only say how many cells there are and which cell a descriptor vector falls in.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np

__all__ = ["AddStatus", "Archive", "Descriptors", "Elite", "QDSnapshot", "QDStats"]

Descriptors = Mapping[str, float] | Sequence[float]
"""By name (extra names are ignored), or a sequence in the archive's ``names`` order."""


class AddStatus(StrEnum):
    """What :meth:`Archive.add` did with a candidate.

    - ``NEW_CELL``: its cell was empty; the candidate is now that cell's elite.
    - ``IMPROVED``: its fitness is *strictly* higher than the cell's elite's; it replaced the elite.
    - ``NOT_ADDED``: the elite is at least as fit (a tie keeps the incumbent, so replaying evaluations
      in order rebuilds the same archive), or the candidate has no finite fitness (``None``, NaN,
      +-inf), or a descriptor is missing a value (``None``/NaN). The archive is unchanged.
    """

    NEW_CELL = "new_cell"
    IMPROVED = "improved"
    NOT_ADDED = "not_added"

    @property
    def added(self) -> bool:
        return self is not AddStatus.NOT_ADDED


@dataclass(frozen=True, kw_only=True)
class Elite:
    """The fittest candidate of a cell. ``descriptors`` are as measured (before clipping)."""

    id: str
    fitness: float
    descriptors: tuple[float, ...]
    cell: int


@dataclass(frozen=True, kw_only=True)
class QDStats:
    """Quality-diversity statistics of an archive.

    ``qd_score`` is the sum over elites of ``fitness - qd_offset``. Choose the offset below any fitness
    the run can reach (0 for throughputs such as GFLOP/s) so that filling a cell always raises the
    score; the score then rewards both coverage and quality. ``best``/``mean`` are ``None`` when empty.
    """

    cells: int
    filled: int
    coverage: float
    qd_score: float
    qd_offset: float
    best: float | None
    mean: float | None


@dataclass(frozen=True, kw_only=True)
class QDSnapshot:
    """A point of the run's QD progress (see :class:`QDStats`): after ``evals`` evaluations, ``elapsed_s`` in."""

    evals: int
    elapsed_s: float
    coverage: float
    qd_score: float
    best: float | None
    mean: float | None
    at: float


class Archive(ABC):
    """A MAP-Elites archive over named descriptors with fixed ``ranges``; values outside are clipped."""

    kind: ClassVar[str]
    _kinds: ClassVar[dict[str, type[Archive]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Archive._kinds[cls.kind] = cls

    def __init__(self, *, names: Sequence[str], ranges: Sequence[tuple[float, float]]) -> None:
        if isinstance(names, str) or not names:
            raise ValueError("an archive needs a non-empty list of descriptor names")
        if len(set(names)) != len(names):
            raise ValueError(f"descriptor names must be unique, got {list(names)}")
        if len(ranges) != len(names):
            raise ValueError(f"{len(names)} descriptor names but {len(ranges)} ranges")
        for name, (lo, hi) in zip(names, ranges, strict=True):
            if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise ValueError(f"descriptor {name!r}: range ({lo}, {hi}) must be finite with low < high")
        self.names: tuple[str, ...] = tuple(names)
        self.ranges: tuple[tuple[float, float], ...] = tuple((float(lo), float(hi)) for lo, hi in ranges)
        self._lower = np.array([lo for lo, _ in self.ranges])
        self._upper = np.array([hi for _, hi in self.ranges])
        self._elites: dict[int, Elite] = {}
        self._sorted: list[Elite] | None = None  # elites by cell, rebuilt after a change

    # -- what a kind of archive defines -----------------------------------------------------------

    @property
    @abstractmethod
    def cells(self) -> int:
        """The total number of cells."""

    @abstractmethod
    def _index(self, x: np.ndarray) -> int:
        """The cell of a finite descriptor vector already clipped into ``ranges``."""

    @abstractmethod
    def _layout(self) -> dict[str, Any]:
        """The constructor arguments beyond ``names`` and ``ranges``, JSON-ready."""

    # -- shared behaviour --------------------------------------------------------------------------

    def _values(self, descriptors: Descriptors) -> np.ndarray:
        if isinstance(descriptors, Mapping):
            missing = [n for n in self.names if n not in descriptors]
            if missing:
                raise ValueError(f"descriptors lack {', '.join(map(repr, missing))} (have {sorted(descriptors)})")
            values = [descriptors[n] for n in self.names]
        else:
            values = list(descriptors)
            if len(values) != len(self.names):
                raise ValueError(f"expected {len(self.names)} descriptors {self.names}, got {len(values)}")
        return np.array([math.nan if v is None else float(v) for v in values])

    def cell_of(self, descriptors: Descriptors) -> int:
        """The cell these descriptors fall in (values outside ``ranges`` are clipped to the edge cells)."""
        x = self._values(descriptors)
        if np.isnan(x).any():
            missing = [n for n, v in zip(self.names, x, strict=True) if np.isnan(v)]
            raise ValueError(f"descriptors have no value for {missing}")
        return self._index(np.clip(x, self._lower, self._upper))

    def add(self, id: str, fitness: float | None, descriptors: Descriptors) -> AddStatus:
        """Offers a candidate to its cell; see :class:`AddStatus` for exactly what wins."""
        if fitness is None or not math.isfinite(fitness):
            return AddStatus.NOT_ADDED
        x = self._values(descriptors)
        if np.isnan(x).any():
            return AddStatus.NOT_ADDED
        cell = self._index(np.clip(x, self._lower, self._upper))
        incumbent = self._elites.get(cell)
        if incumbent is not None and not fitness > incumbent.fitness:
            return AddStatus.NOT_ADDED
        self._elites[cell] = Elite(id=id, fitness=float(fitness), descriptors=tuple(x.tolist()), cell=cell)
        self._sorted = None
        return AddStatus.NEW_CELL if incumbent is None else AddStatus.IMPROVED

    def elites(self) -> list[Elite]:
        """All elites, by cell index."""
        if self._sorted is None:
            self._sorted = [self._elites[c] for c in sorted(self._elites)]
        return list(self._sorted)

    def elite(self, cell: int) -> Elite | None:
        """The elite of a cell, ``None`` if the cell is empty."""
        if not 0 <= cell < self.cells:
            raise IndexError(f"cell {cell} is outside 0..{self.cells - 1}")
        return self._elites.get(cell)

    def __len__(self) -> int:
        return len(self._elites)

    def sample(self, rng: np.random.Generator, k: int) -> list[Elite]:
        """``k`` elites drawn uniformly with replacement (reproducible for a given ``rng`` and archive)."""
        if not self._elites:
            raise ValueError("cannot sample from an empty archive")
        elites = self.elites()
        return [elites[i] for i in rng.integers(len(elites), size=k)]

    def stats(self, *, qd_offset: float = 0.0) -> QDStats:
        """Coverage, QD score (see :class:`QDStats` for ``qd_offset``), best and mean elite fitness."""
        f = np.array([e.fitness for e in self._elites.values()])
        return QDStats(
            cells=self.cells,
            filled=len(f),
            coverage=len(f) / self.cells,
            qd_score=float(np.sum(f - qd_offset)),
            qd_offset=qd_offset,
            best=float(f.max()) if len(f) else None,
            mean=float(f.mean()) if len(f) else None,
        )

    def layout(self) -> dict[str, Any]:
        """The archive's definition, JSON-ready: ``Archive.from_layout(a.layout())`` is an empty twin of ``a``."""
        ranges = [list(r) for r in self.ranges]
        return {"kind": self.kind, "names": list(self.names), "ranges": ranges, **self._layout()}

    @classmethod
    def from_layout(cls, layout: Mapping[str, Any]) -> Archive:
        """Builds an empty archive from :meth:`layout`'s output (the kind is read from ``layout['kind']``)."""
        kind = layout.get("kind")
        impl = Archive._kinds.get(str(kind))
        if impl is None:
            raise ValueError(f"unknown archive kind {kind!r} (known: {sorted(Archive._kinds)})")
        if not issubclass(impl, cls):
            raise ValueError(f"layout is a {kind!r} archive, not a {cls.__name__}")
        args = {k: v for k, v in layout.items() if k != "kind"}
        args["ranges"] = [tuple(r) for r in args.get("ranges", [])]
        try:
            return impl(**args)
        except TypeError as exc:  # unknown or missing keys
            raise ValueError(f"bad {kind!r} archive layout: {exc}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(names={list(self.names)}, cells={self.cells}, filled={len(self)})"
