"""Typed parameter domains: integer ranges, powers of two, floats (linear or log) and choices.

Each domain is a pydantic model so a space declared in YAML is validated with a precise key path,
and each knows how to sample, test membership, and snap an arbitrary value to its nearest member.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ChoiceParam", "FloatParam", "IntParam", "Param", "Pow2Param"]

Scalar = int | float | str | bool


class _Domain(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @property
    def discrete(self) -> bool:
        return True

    def values(self) -> tuple[Scalar, ...]:
        """All members, in order (discrete domains only)."""
        raise NotImplementedError

    def sample(self, rng: np.random.Generator) -> Scalar:
        vals = self.values()
        return vals[int(rng.integers(len(vals)))]

    def contains(self, value: Any) -> bool:
        return value in self.values()

    def snap(self, value: Any) -> Scalar:
        """The member nearest to ``value`` (used to repair out-of-domain children)."""
        vals = self.values()
        if value in vals:
            return value
        try:
            x = float(value)
        except (TypeError, ValueError):
            return vals[0]
        return min(vals, key=lambda v: abs(float(v) - x))

    def index(self, value: Any) -> int:
        return self.values().index(self.snap(value))


class IntParam(_Domain):
    """Integers ``low, low+step, ..., <= high``."""

    type: Literal["int"]
    low: int
    high: int
    step: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> IntParam:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def values(self) -> tuple[int, ...]:
        return tuple(range(self.low, self.high + 1, self.step))

    def contains(self, value: Any) -> bool:
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and self.low <= value <= self.high
            and (value - self.low) % self.step == 0
        )


class Pow2Param(_Domain):
    """Powers of two between ``low`` and ``high`` inclusive (both powers of two)."""

    type: Literal["pow2"]
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _powers(self) -> Pow2Param:
        for v in (self.low, self.high):
            if v & (v - 1):
                raise ValueError(f"{v} is not a power of two")
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def values(self) -> tuple[int, ...]:
        return tuple(1 << e for e in range(self.low.bit_length() - 1, self.high.bit_length()))

    def contains(self, value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value in self.values()


class FloatParam(_Domain):
    """Reals in ``[low, high]``, sampled uniformly or log-uniformly."""

    type: Literal["float"]
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> FloatParam:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        if self.log and self.low <= 0:
            raise ValueError("a log-scaled float needs low > 0")
        return self

    @property
    def discrete(self) -> bool:
        return False

    def values(self) -> tuple[float, ...]:
        raise TypeError("a float domain has no finite list of values")

    def sample(self, rng: np.random.Generator) -> float:
        if self.log:
            return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))
        return float(rng.uniform(self.low, self.high))

    def contains(self, value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and self.low <= value <= self.high

    def snap(self, value: Any) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            return self.low
        if math.isnan(x):
            return self.low
        return min(max(x, self.low), self.high)

    def index(self, value: Any) -> int:
        raise TypeError("a float domain has no index")


class ChoiceParam(_Domain):
    """One of a list of values (strings, numbers or booleans)."""

    type: Literal["choice"]
    values_: tuple[Scalar, ...] = Field(alias="values", min_length=1)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    def values(self) -> tuple[Scalar, ...]:
        return self.values_

    def contains(self, value: Any) -> bool:
        return any(type(value) is type(v) and value == v for v in self.values_)

    def snap(self, value: Any) -> Scalar:
        """``value`` if a member; among numbers, the nearest one; else the first."""
        if self.contains(value):
            return value
        numbers = [v for v in self.values_ if isinstance(v, int | float) and not isinstance(v, bool)]
        if numbers and isinstance(value, int | float) and not isinstance(value, bool):
            return min(numbers, key=lambda v: abs(float(v) - float(value)))
        return self.values_[0]


Param = Annotated[IntParam | Pow2Param | FloatParam | ChoiceParam, Field(discriminator="type")]
