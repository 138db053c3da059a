"""Variation operators: one protocol, one small module per family."""

from evo.operators._base import Operator, Proposal, ProposalContext
from evo.operators.classical import Crossover, Mutate, RandomSample
from evo.operators.codec import GeneCodec, seeded_random

__all__ = [
    "Crossover",
    "GeneCodec",
    "Mutate",
    "Operator",
    "Proposal",
    "ProposalContext",
    "RandomSample",
    "build_operators",
    "seeded_random",
]


def build_operators(config) -> dict[str, Operator]:  # noqa: ANN001 - evo.config.OperatorsConfig
    """The classical operators named in ``config.weights`` with a positive weight (LLM ones: evo.llm.build)."""
    available: dict[str, Operator] = {
        "mutate": Mutate(config),
        "crossover": Crossover(config),
        "random": RandomSample(),
    }
    return {name: available[name] for name, w in config.weights.items() if w > 0 and name in available}
