"""``calculator``: a built-in tool that evaluates arithmetic, safely.

The expression is parsed with :mod:`ast` and walked over a whitelist: numbers (int, float), the binary
operators ``+ - * / // % **``, unary ``-``/``+`` and parentheses. Names, attributes, calls, strings,
comparisons and everything else are refused before anything is computed, and sizes are bounded so a
reply like ``9**9**9`` is refused at once instead of computing a number with 370 million digits.
Nothing is ever passed to ``eval``.
"""

from __future__ import annotations

import ast
import math
import operator

MAX_EXPRESSION_CHARS = 256
MAX_INT_BITS = 1024  # ~308 decimal digits: any intermediate integer larger than this is refused

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Supports integers and decimals, + - * / // % ** (power), unary minus and parentheses.

    Args:
        expression: the arithmetic expression, e.g. "(12 + 3) * 4" or "2 ** 10 / 3".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__} {expression!r}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is {len(expression)} characters long; at most {MAX_EXPRESSION_CHARS} are allowed")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {expression!r} ({err.msg})") from None
    try:
        return _format(_evaluate(tree.body))
    except RecursionError:  # e.g. 200 nested unary minuses: deeper than the walker may recurse
        raise ValueError(f"{expression!r} is nested too deeply") from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        op = type(node.op)
        if op is ast.Pow:
            _check_power(left, right)
        if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise ValueError(f"division by zero in {left} {_SYMBOL[op]} {right}")
        try:
            return _checked(_BINARY[op](left, right))
        except OverflowError:
            raise ValueError(f"{left} {_SYMBOL[op]} {right} is too large") from None
    raise ValueError(f"{_describe(node)} is not allowed; use numbers, + - * / // % **, unary minus and parentheses")


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would exceed the size bound, before computing it."""
    if isinstance(exponent, float) and isinstance(base, (int, float)) and base < 0 and not exponent.is_integer():
        raise ValueError(f"{base} ** {exponent} is not a real number")
    magnitude = abs(base)
    if magnitude > 1 and exponent > 0 and exponent * math.log2(magnitude) > MAX_INT_BITS:
        raise ValueError(f"{base} ** {exponent} is too large (results are limited to {MAX_INT_BITS} bits)")
    if magnitude == 0 and exponent < 0:
        raise ValueError(f"division by zero in {base} ** {exponent}")


def _checked(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ValueError(f"a number with {value.bit_length()} bits is too large (the limit is {MAX_INT_BITS} bits)")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"the result is not finite ({value})")
    return value


def _format(value: int | float) -> str:
    """Integers exactly; floats with up to 12 significant digits (``0.1 + 0.2`` → ``0.3``)."""
    return str(value) if isinstance(value, int) else format(value, ".12g")


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.Attribute):
        return f"the attribute .{node.attr}"
    if isinstance(node, ast.Call):
        return "a function call"
    return f"{type(node).__name__} ({ast.unparse(node)!r})"
