"""A small safe evaluator for constraint expressions such as ``"MC % MR == 0"``.

Expressions are parsed with :mod:`ast` and only a whitelist of node types is accepted: arithmetic,
comparisons, boolean logic, ``in`` over literal tuples, and calls to ``min``/``max``/``abs``. Nothing
is ever passed to ``eval``.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Expression", "ExpressionError"]


class ExpressionError(ValueError):
    """An expression that cannot be parsed, uses a forbidden construct, or fails to evaluate."""


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_FUNCS: dict[str, Callable[..., Any]] = {"min": min, "max": max, "abs": abs}
_MAX_POW = 64  # bounds ``a ** b`` so a constraint cannot allocate a huge integer


class Expression:
    """A parsed, validated expression over named parameters."""

    def __init__(self, text: str) -> None:
        self.text = text
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except SyntaxError as exc:
            raise ExpressionError(f"cannot parse {text!r}: {exc.msg}") from None
        self._body = tree.body
        self.names: frozenset[str] = frozenset(self._check(self._body))

    def __repr__(self) -> str:
        return f"Expression({self.text!r})"

    def _check(self, node: ast.AST) -> set[str]:
        """Rejects any node outside the whitelist; returns the free names."""
        match node:
            case ast.Constant(value=v) if isinstance(v, (int, float, str, bool)):
                return set()
            case ast.Name(id=name):
                if name in _FUNCS:
                    raise ExpressionError(f"{self.text!r}: {name!r} can only be called")
                return {name}
            case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINOPS:
                return self._check(left) | self._check(right)
            case ast.UnaryOp(op=op, operand=operand) if type(op) in _UNARY:
                return self._check(operand)
            case ast.BoolOp(values=values):
                return set().union(*(self._check(v) for v in values))
            case ast.Compare(left=left, ops=ops, comparators=comps) if all(type(o) in _CMPOPS for o in ops):
                return self._check(left).union(*(self._check(c) for c in comps))
            case ast.Tuple(elts=elts) | ast.List(elts=elts):
                return set().union(*(self._check(e) for e in elts))
            case ast.Call(func=ast.Name(id=fn), args=args, keywords=[]) if fn in _FUNCS:
                return set().union(*(self._check(a) for a in args))
            case ast.IfExp(test=test, body=body, orelse=orelse):
                return self._check(test) | self._check(body) | self._check(orelse)
        raise ExpressionError(f"{self.text!r}: {type(node).__name__} is not allowed in an expression")

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """Evaluates with parameter values from ``env``; unknown names raise :class:`ExpressionError`."""
        missing = self.names - env.keys()
        if missing:
            raise ExpressionError(f"{self.text!r}: unknown name(s) {', '.join(sorted(missing))}")
        try:
            return self._eval(self._body, env)
        except ExpressionError:
            raise
        except (ArithmeticError, TypeError, ValueError) as exc:
            raise ExpressionError(f"{self.text!r}: {exc}") from None

    def _eval(self, node: ast.AST, env: Mapping[str, Any]) -> Any:
        match node:
            case ast.Constant(value=v):
                return v
            case ast.Name(id=name):
                return env[name]
            case ast.BinOp(left=left, op=op, right=right):
                a, b = self._eval(left, env), self._eval(right, env)
                if isinstance(op, ast.Pow) and abs(b) > _MAX_POW:
                    raise ExpressionError(f"{self.text!r}: exponent {b} is too large")
                return _BINOPS[type(op)](a, b)
            case ast.UnaryOp(op=op, operand=operand):
                return _UNARY[type(op)](self._eval(operand, env))
            case ast.BoolOp(op=ast.And(), values=values):
                return all(self._eval(v, env) for v in values)
            case ast.BoolOp(values=values):
                return any(self._eval(v, env) for v in values)
            case ast.Compare(left=left, ops=ops, comparators=comps):
                a = self._eval(left, env)
                for op, comp in zip(ops, comps, strict=True):
                    b = self._eval(comp, env)
                    if not _CMPOPS[type(op)](a, b):
                        return False
                    a = b
                return True
            case ast.Tuple(elts=elts) | ast.List(elts=elts):
                return tuple(self._eval(e, env) for e in elts)
            case ast.Call(func=ast.Name(id=fn), args=args):
                return _FUNCS[fn](*(self._eval(a, env) for a in args))
            case ast.IfExp(test=test, body=body, orelse=orelse):
                return self._eval(body, env) if self._eval(test, env) else self._eval(orelse, env)
        raise ExpressionError(f"{self.text!r}: cannot evaluate {type(node).__name__}")  # unreachable after _check
