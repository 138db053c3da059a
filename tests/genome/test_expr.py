import pytest
from hypothesis import given
from hypothesis import strategies as st

from genome import Expression, ExpressionError


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("MC % MR == 0", {"MC": 64, "MR": 8}, True),
        ("MC % MR == 0", {"MC": 60, "MR": 8}, False),
        ("MR * NR <= 128", {"MR": 8, "NR": 16}, True),
        ("MR * NR <= 128", {"MR": 16, "NR": 16}, False),
        ("ORDER in ('ijk', 'ikj') and U >= 1", {"ORDER": "ikj", "U": 2}, True),
        ("not (A < B < C)", {"A": 1, "B": 3, "C": 2}, True),
        ("max(A, B) - min(A, B) == abs(A - B)", {"A": -4, "B": 7}, True),
        ("2 ** K <= 1024 if FLAG else True", {"K": 11, "FLAG": True}, False),
    ],
)
def test_evaluates_whitelisted_expressions(text, env, expected):
    assert Expression(text).evaluate(env) is expected


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "A.__class__",
        "open('/etc/passwd')",
        "[x for x in range(10)]",
        "lambda: 1",
        "A[0]",
        "min",
        "exec('1')",
    ],
)
def test_rejects_everything_outside_the_whitelist(text):
    with pytest.raises(ExpressionError):
        Expression(text)


def test_reports_syntax_errors_and_unknown_names():
    with pytest.raises(ExpressionError, match="cannot parse"):
        Expression("MC %% MR")
    with pytest.raises(ExpressionError, match="unknown name"):
        Expression("A + B > 0").evaluate({"A": 1})


def test_arithmetic_errors_become_expression_errors():
    with pytest.raises(ExpressionError):
        Expression("A % B == 0").evaluate({"A": 1, "B": 0})
    with pytest.raises(ExpressionError, match="too large"):
        Expression("2 ** B").evaluate({"B": 10_000})


def test_names_are_the_free_variables():
    assert Expression("MC % MR == 0 and max(KC, 4) > U").names == {"MC", "MR", "KC", "U"}


@given(a=st.integers(-1000, 1000), b=st.integers(1, 1000))
def test_matches_python_semantics_on_integers(a, b):
    assert Expression("a % b + a // b * 2 - (a < b)").evaluate({"a": a, "b": b}) == a % b + a // b * 2 - (a < b)


@given(st.text(max_size=40))
def test_never_raises_anything_but_expression_error(text):
    try:
        Expression(text).evaluate({})
    except ExpressionError:
        pass
