"""Classical variation with DEAP's operators, behind the typed gene codec.

int and pow2 genes move by a Gaussian step on their index; floats by bounded polynomial mutation;
choices are resampled uniformly; crossover is uniform. Children are repaired into the space's
constraints, and a child identical to its parent is retried.
"""

from __future__ import annotations

import random

from deap import tools

from evo.config import OperatorsConfig
from evo.operators._base import Operator, ProposalContext
from evo.operators.codec import GeneCodec, seeded_random
from genome import Genome

__all__ = ["Crossover", "Mutate", "RandomSample"]

_RETRIES = 20


def _child(parent: Genome, params: dict, ctx: ProposalContext) -> Genome | None:
    repaired = ctx.space.repair(params, ctx.rng)
    if repaired is None:
        return None
    # A parent without params is a code genome that ignores the template (e.g. a naive seed): its
    # children continue on the template, which is what the params describe.
    source = parent.source if parent.params else None
    return Genome(params=repaired, source=source)


class Mutate(Operator):
    name = "mutate"
    arity = 1
    blocking = False

    def __init__(self, config: OperatorsConfig) -> None:
        self.cfg = config.mutation

    def propose(self, ctx: ProposalContext) -> Genome | None:
        (parent,) = ctx.parent_genomes
        if not ctx.space.params:
            return None
        codec = GeneCodec(ctx.space)
        base = codec.encode(parent.params)
        with seeded_random(ctx.rng):
            for _ in range(_RETRIES):
                genes = list(base)
                for i in range(len(genes)):
                    if random.random() >= self.cfg.indpb:
                        continue
                    if codec.is_float(i):
                        dom = codec.domains[i]
                        (genes[i],) = tools.mutPolynomialBounded(
                            [genes[i]], eta=self.cfg.eta, low=dom.low, up=dom.high, indpb=1.0
                        )[0]
                    elif codec.is_choice(i):
                        (genes[i],) = tools.mutUniformInt([int(genes[i])], low=0, up=codec.upper_index(i), indpb=1.0)[0]
                    else:
                        (step,) = tools.mutGaussian([0.0], mu=0.0, sigma=self.cfg.index_sigma, indpb=1.0)[0]
                        # at least one index step, so a mutated gene always moves
                        step = round(step) or (1 if random.random() < 0.5 else -1)
                        genes[i] = min(max(genes[i] + step, 0), codec.upper_index(i))
                child = _child(parent, codec.decode(genes), ctx)
                if child is not None and child.params != parent.params:
                    return child
        return None


class Crossover(Operator):
    name = "crossover"
    arity = 2
    blocking = False

    def __init__(self, config: OperatorsConfig) -> None:
        self.indpb = config.crossover_indpb

    def propose(self, ctx: ProposalContext) -> Genome | None:
        a, b = ctx.parent_genomes
        if not ctx.space.params:
            return None
        codec = GeneCodec(ctx.space)
        ga, gb = codec.encode(a.params), codec.encode(b.params)
        with seeded_random(ctx.rng):
            for _ in range(_RETRIES):
                x, _y = tools.cxUniform(list(ga), list(gb), indpb=self.indpb)
                child = _child(a, codec.decode(x), ctx)
                if child is not None and child.params not in (a.params, b.params):
                    return child
        return None


class RandomSample(Operator):
    """A fresh valid point of the space: keeps exploring whatever the archive holds."""

    name = "random"
    arity = 0
    blocking = False

    def propose(self, ctx: ProposalContext) -> Genome | None:
        if not ctx.space.params:
            return None
        return Genome(params=ctx.space.sample(ctx.rng))
