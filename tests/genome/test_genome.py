import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from genome import Genome, canonical_json, evolve_blocks, render_defines, render_source

scalars = st.one_of(st.integers(-(2**31), 2**31), st.booleans(), st.text(max_size=8),
                    st.floats(allow_nan=False, allow_infinity=False))


def test_id_is_sha256_of_canonical_json():
    g = Genome(params={"b": 2, "a": 1}, source="int x;")
    expected = hashlib.sha256(b'{"params":{"a":1,"b":2},"source":"int x;"}').hexdigest()
    assert g.id == expected


def test_same_genome_same_id_whatever_the_key_order():
    assert Genome({"a": 1, "b": 2}).id == Genome({"b": 2, "a": 1}).id
    assert Genome({"a": 1}).id != Genome({"a": 2}).id
    assert Genome({"a": 1}).id != Genome({"a": 1}, source="").id


@given(st.dictionaries(st.text(min_size=1, max_size=5), scalars, max_size=6), st.none() | st.text(max_size=50))
def test_json_round_trip(params, source):
    g = Genome(params=params, source=source)
    again = Genome.from_json(g.to_json())
    assert again == g and again.id == g.id


def test_canonical_json_rejects_nan():
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_defines_cover_numbers_bools_and_choices():
    text = render_defines({"MR": 8, "FAST": True, "ORDER": "i-k-j", "EPS": 0.5})
    assert "#define MR 8\n" in text
    assert "#define FAST 1\n" in text
    assert '#define ORDER "i-k-j"\n' in text
    assert "#define ORDER_I_K_J 1\n" in text
    assert "#define EPS 0.5\n" in text
    assert render_source({"A": 1}, "int f(void) { return A; }").endswith("#line 1\nint f(void) { return A; }")


def test_evolve_blocks_are_found_and_checked():
    src = (
        "a\n// EVOLVE-BLOCK-START\nb\nc\n// EVOLVE-BLOCK-END\nd\n"
        "/* EVOLVE-BLOCK-START */\ne\n/* EVOLVE-BLOCK-END */\n"
    )
    assert evolve_blocks(src) == [(2, 4), (7, 8)]
    with pytest.raises(ValueError, match="never closed"):
        evolve_blocks("// EVOLVE-BLOCK-START\nx\n")
    with pytest.raises(ValueError, match="without a start"):
        evolve_blocks("x\n// EVOLVE-BLOCK-END\n")
    with pytest.raises(ValueError, match="nested"):
        evolve_blocks("// EVOLVE-BLOCK-START\n// EVOLVE-BLOCK-START\n")
