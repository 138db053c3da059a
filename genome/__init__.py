"""What a candidate *is*: typed parameter spaces, constraints, genomes and canonical ids."""

from genome._expr import Expression, ExpressionError
from genome._genome import Genome, canonical_json
from genome._params import ChoiceParam, FloatParam, IntParam, Param, Pow2Param
from genome._source import EVOLVE_END, EVOLVE_START, evolve_blocks, render_defines, render_source
from genome._space import ParamSpace, SpaceError, SpaceSpec

__all__ = [
    "EVOLVE_END",
    "EVOLVE_START",
    "ChoiceParam",
    "Expression",
    "ExpressionError",
    "FloatParam",
    "Genome",
    "IntParam",
    "Param",
    "ParamSpace",
    "Pow2Param",
    "SpaceError",
    "SpaceSpec",
    "canonical_json",
    "evolve_blocks",
    "render_defines",
    "render_source",
]
