"""A parameter space: named domains plus constraints between them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from genome._expr import Expression, ExpressionError
from genome._params import ChoiceParam, FloatParam, IntParam, Param, Scalar

__all__ = ["ParamSpace", "SpaceError", "SpaceSpec"]


class SpaceError(ValueError):
    """A space that is ill-declared, or a point that cannot be made valid."""


class SpaceSpec(BaseModel):
    """The YAML form of a space: ``params: {NAME: {type: ...}}`` and ``constraints: ["expr", ...]``."""

    model_config = ConfigDict(extra="forbid")

    params: dict[str, Param] = Field(default_factory=dict)
    constraints: list[str] = Field(default_factory=list)

    @field_validator("params", mode="before")
    @classmethod
    def _lists_are_choices(cls, v: Any) -> Any:
        # ``NAME: [a, b, c]`` is shorthand for a choice.
        if isinstance(v, Mapping):
            return {k: ({"type": "choice", "values": d} if isinstance(d, list) else d) for k, d in v.items()}
        return v

    @field_validator("constraints")
    @classmethod
    def _parse(cls, v: list[str]) -> list[str]:
        for text in v:
            try:
                Expression(text)
            except ExpressionError as exc:
                raise ValueError(str(exc)) from None
        return v


_ParamAdapter: TypeAdapter[Any] = TypeAdapter(Param)


class ParamSpace:
    """Named parameter domains with constraints; samples, checks and repairs points."""

    def __init__(self, params: Mapping[str, Any], constraints: list[str] | tuple[str, ...] = ()) -> None:
        self.params = {name: (_ParamAdapter.validate_python(d) if isinstance(d, dict) else d)
                       for name, d in params.items()}
        self.constraints = [Expression(c) for c in constraints]
        for c in self.constraints:
            unknown = c.names - self.params.keys()
            if unknown:
                raise SpaceError(f"constraint {c.text!r} names unknown parameter(s): {', '.join(sorted(unknown))}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ParamSpace:
        try:
            spec = SpaceSpec.model_validate(data)
        except ValidationError as exc:
            raise SpaceError(str(exc)) from None
        return cls(spec.params, spec.constraints)

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": {n: d.model_dump(by_alias=True) for n, d in self.params.items()},
            "constraints": [c.text for c in self.constraints],
        }

    def json_schema(self, *, max_enum: int = 256) -> dict[str, Any]:
        """A JSON schema of one point of this space: every parameter, in order, each within its domain (a discrete
        domain of up to ``max_enum`` members as their list). The constraints are not in it: a point still has to
        hold them."""
        props: dict[str, Any] = {}
        for name, d in self.params.items():
            if isinstance(d, FloatParam):
                props[name] = {"type": "number", "minimum": d.low, "maximum": d.high}
            elif isinstance(d, IntParam) and (d.high - d.low) // d.step >= max_enum:
                props[name] = {"type": "integer", "minimum": d.low, "maximum": d.high}
            else:
                props[name] = {"enum": list(d.values())}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    def __len__(self) -> int:
        return len(self.params)

    def names(self) -> list[str]:
        return list(self.params)

    # --- checking -------------------------------------------------------------------------------

    def violations(self, point: Mapping[str, Any]) -> list[str]:
        """Every reason ``point`` is not a member of the space (empty when it is)."""
        problems = [f"unknown parameter {k!r}" for k in point if k not in self.params]
        for name, dom in self.params.items():
            if name not in point:
                problems.append(f"missing parameter {name!r}")
            elif not dom.contains(point[name]):
                problems.append(f"{name}={point[name]!r} is outside its domain")
        if problems:
            return problems
        for c in self.constraints:
            try:
                if not c.evaluate(point):
                    problems.append(f"constraint {c.text!r} is false")
            except ExpressionError as exc:
                problems.append(str(exc))
        return problems

    def is_valid(self, point: Mapping[str, Any]) -> bool:
        return not self.violations(point)

    def _failing(self, point: Mapping[str, Any]) -> list[Expression]:
        out = []
        for c in self.constraints:
            try:
                ok = c.evaluate(point)
            except ExpressionError:
                ok = False
            if not ok:
                out.append(c)
        return out

    # --- generating -----------------------------------------------------------------------------

    def sample(self, rng: np.random.Generator, *, max_tries: int = 10_000) -> dict[str, Scalar]:
        """A uniformly drawn valid point (rejection sampling)."""
        for _ in range(max_tries):
            point = {n: d.sample(rng) for n, d in self.params.items()}
            if not self._failing(point):
                return point
        raise SpaceError(f"no valid point found in {max_tries} samples: are the constraints satisfiable?")

    def repair(self, point: Mapping[str, Any], rng: np.random.Generator, *, max_tries: int = 200) -> dict | None:
        """Snaps values into their domains, then resamples parameters of failing constraints.

        Returns a valid point as close to ``point`` as this cheap local search finds, or ``None``.
        """
        fixed = {n: d.snap(point[n]) if n in point else d.sample(rng) for n, d in self.params.items()}
        for _ in range(max_tries):
            failing = self._failing(fixed)
            if not failing:
                return fixed
            names = sorted(set().union(*(c.names for c in failing)))
            name = names[int(rng.integers(len(names)))]
            fixed[name] = self.params[name].sample(rng)
        return None

    def choice_names(self) -> list[str]:
        return [n for n, d in self.params.items() if isinstance(d, ChoiceParam)]
