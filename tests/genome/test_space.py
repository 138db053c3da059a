import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from genome import ParamSpace, SpaceError

SPEC = {
    "params": {
        "MR": {"type": "int", "low": 2, "high": 16, "step": 2},
        "NR": {"type": "pow2", "low": 8, "high": 64},
        "MC": {"type": "pow2", "low": 16, "high": 256},
        "ALPHA": {"type": "float", "low": 0.01, "high": 10.0, "log": True},
        "ORDER": ["ijk", "ikj", "jik"],
    },
    "constraints": ["MC % MR == 0", "MR * NR <= 128"],
}


@pytest.fixture
def space():
    return ParamSpace.from_dict(SPEC)


def test_domains_enumerate_their_values(space):
    assert space.params["MR"].values() == (2, 4, 6, 8, 10, 12, 14, 16)
    assert space.params["NR"].values() == (8, 16, 32, 64)
    assert space.params["ORDER"].values() == ("ijk", "ikj", "jik")


def test_samples_are_valid_and_reproducible(space):
    a = [space.sample(np.random.default_rng(7)) for _ in range(3)]
    b = [space.sample(np.random.default_rng(7)) for _ in range(3)]
    assert a == b
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = space.sample(rng)
        assert space.violations(p) == []
        assert 0.01 <= p["ALPHA"] <= 10.0


def test_violations_name_the_problem(space):
    p = {"MR": 16, "NR": 64, "MC": 48, "ALPHA": 1.0, "ORDER": "ijk"}
    problems = space.violations(p)
    assert "MC=48 is outside its domain" in problems
    p["MC"] = 64
    assert space.violations(p) == ["constraint 'MR * NR <= 128' is false"]
    assert "missing parameter 'ORDER'" in space.violations({k: v for k, v in p.items() if k != "ORDER"})
    assert "unknown parameter 'X'" in space.violations({**p, "X": 1})


def test_repair_snaps_and_satisfies_constraints(space):
    rng = np.random.default_rng(3)
    fixed = space.repair({"MR": 17, "NR": 100, "MC": 300, "ALPHA": 99.0, "ORDER": "zzz"}, rng)
    assert fixed is not None and space.is_valid(fixed)
    assert fixed["ALPHA"] == 10.0 and fixed["MC"] == 256 and fixed["ORDER"] == "ijk"


@settings(max_examples=50, deadline=None)
@given(
    mr=st.integers(-50, 50),
    nr=st.integers(0, 500),
    mc=st.integers(0, 1000),
    alpha=st.floats(allow_nan=True, allow_infinity=False),
    seed=st.integers(0, 2**32),
)
def test_repair_always_returns_a_member_or_none(mr, nr, mc, alpha, seed):
    space = ParamSpace.from_dict(SPEC)
    out = space.repair({"MR": mr, "NR": nr, "MC": mc, "ALPHA": alpha, "ORDER": "ikj"}, np.random.default_rng(seed))
    assert out is None or space.is_valid(out)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"params": {"A": {"type": "int", "low": 5, "high": 1}}}, "must be >= low"),
        ({"params": {"A": {"type": "pow2", "low": 3, "high": 8}}}, "not a power of two"),
        ({"params": {"A": {"type": "float", "low": 0, "high": 1, "log": True}}}, "log-scaled"),
        ({"params": {"A": {"type": "int", "low": 1, "high": 2, "stride": 1}}}, "Extra inputs"),
        ({"params": {"A": {"type": "matrix"}}}, "does not match any of the expected tags"),
        ({"params": {"A": [1, 2]}, "constraints": ["A +"]}, "cannot parse"),
        ({"params": {"A": [1, 2]}, "constraints": ["B > 1"]}, "unknown parameter"),
    ],
)
def test_bad_declarations_are_rejected(spec, match):
    with pytest.raises((SpaceError, ValueError), match=match):
        ParamSpace.from_dict(spec)


def test_unsatisfiable_constraints_fail_clearly():
    space = ParamSpace.from_dict({"params": {"A": [1, 2]}, "constraints": ["A > 5"]})
    with pytest.raises(SpaceError, match="satisfiable"):
        space.sample(np.random.default_rng(0), max_tries=50)


def test_round_trips_through_its_dict(space):
    again = ParamSpace.from_dict(space.to_dict())
    assert again.to_dict() == space.to_dict()
