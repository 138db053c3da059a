import random

import numpy as np
import pytest

from evo.config import OperatorsConfig, SelectionConfig
from evo.operators import Crossover, GeneCodec, Mutate, ProposalContext, RandomSample, seeded_random
from evo.selection import Curiosity, select_parents
from genome import Genome, ParamSpace

SPACE = ParamSpace.from_dict({
    "params": {
        "MR": {"type": "int", "low": 2, "high": 16, "step": 2},
        "NR": {"type": "pow2", "low": 8, "high": 64},
        "ALPHA": {"type": "float", "low": 0.1, "high": 10.0},
        "ORDER": ["ijk", "ikj", "jik"],
    },
    "constraints": ["MR * NR <= 256"],
})


class Stored:
    """Stands for an archive.Candidate: operators read only its genome here."""

    def __init__(self, genome: Genome) -> None:
        self.genome = genome


def ctx(seed: int, *parents: Genome) -> ProposalContext:
    return ProposalContext(space=SPACE, rng=np.random.default_rng(seed), parents=[Stored(g) for g in parents])


def test_codec_round_trips_members():
    codec = GeneCodec(SPACE)
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = SPACE.sample(rng)
        assert codec.decode(codec.encode(p)) == p


def test_mutation_gives_a_valid_different_child_reproducibly():
    parent = Genome(SPACE.sample(np.random.default_rng(1)))
    op = Mutate(OperatorsConfig())
    children = [op.propose(ctx(s, parent)) for s in range(30)]
    assert all(c is not None and SPACE.is_valid(c.params) and c.params != parent.params for c in children)
    assert [c.id for c in children] == [op.propose(ctx(s, parent)).id for s in range(30)]
    assert len({c.id for c in children}) > 10


def test_index_mutation_moves_locally():
    parent = Genome({"MR": 8, "NR": 16, "ALPHA": 1.0, "ORDER": "ijk"})
    cfg = OperatorsConfig(mutation={"indpb": 1.0, "index_sigma": 0.5})
    steps = [abs(Mutate(cfg).propose(ctx(s, parent)).params["MR"] - 8) // 2 for s in range(100)]
    # repair may resample a gene to meet a constraint; typical steps stay small
    assert np.median(steps) <= 1 and np.mean(steps) < 2


def test_crossover_mixes_parents():
    a = Genome({"MR": 2, "NR": 8, "ALPHA": 0.5, "ORDER": "ijk"})
    b = Genome({"MR": 16, "NR": 16, "ALPHA": 9.0, "ORDER": "jik"})
    op = Crossover(OperatorsConfig())
    for s in range(20):
        child = op.propose(ctx(s, a, b))
        assert child is not None and SPACE.is_valid(child.params)
        for k, v in child.params.items():
            assert v in (a.params[k], b.params[k]) or not SPACE.is_valid({**a.params, k: v})


def test_children_of_a_code_genome_without_params_use_the_template():
    naive = Genome(params={}, source="void kernel(void) {}")
    child = Mutate(OperatorsConfig()).propose(ctx(0, naive))
    assert child.source is None and SPACE.is_valid(child.params)
    evolved = Genome(params=SPACE.sample(np.random.default_rng(0)), source="/* evolved */")
    assert Mutate(OperatorsConfig()).propose(ctx(0, evolved)).source == "/* evolved */"


def test_random_sample_is_valid():
    assert SPACE.is_valid(RandomSample().propose(ctx(3)).params)


def test_seeded_random_restores_global_state():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    with seeded_random(np.random.default_rng(5)):
        inside = [random.random() for _ in range(3)]
    assert random.random() == expected
    with seeded_random(np.random.default_rng(5)):
        assert [random.random() for _ in range(3)] == inside


class E:
    def __init__(self, id, fitness):
        self.id, self.fitness = id, fitness


def test_tournament_prefers_fitter_elites():
    elites = [E(str(i), float(i)) for i in range(20)]
    cfg = SelectionConfig(scheme="tournament", tournament_size=4, uniform_fraction=0.0)
    picks = select_parents(elites, 2000, np.random.default_rng(0), cfg)
    uni = select_parents(elites, 2000, np.random.default_rng(0), SelectionConfig(scheme="uniform"))
    assert np.mean([p.fitness for p in picks]) > np.mean([p.fitness for p in uni]) + 3


def test_curiosity_prefers_productive_parents():
    elites = [E(str(i), 1.0) for i in range(10)]
    cur = Curiosity()
    cur.update(["3"], added=True)
    cur.update(["3"], added=True)
    for i in range(10):
        if i != 3:
            cur.update([str(i)], added=False)
    cfg = SelectionConfig(scheme="curiosity", tournament_size=4, uniform_fraction=0.0)
    picks = select_parents(elites, 1000, np.random.default_rng(0), cfg, cur)
    share = sum(p.id == "3" for p in picks) / len(picks)
    assert share > 0.25  # uniform would give 0.1


def test_selection_needs_elites():
    with pytest.raises(ValueError):
        select_parents([], 1, np.random.default_rng(0), SelectionConfig())
