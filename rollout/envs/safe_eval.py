"""A safe arithmetic evaluator (the ``calculator`` tool's engine).

:func:`evaluate` never calls ``eval``: it parses with :mod:`ast` and walks a whitelist — number literals,
``+ - * / // % **``, unary ``+``/``-`` and parentheses. Names, calls, attributes, subscripts, strings,
comparisons, lambdas... are rejected before anything is computed, so ``__import__('os')`` is a syntax
error to it, not a security question. Denial of service is bounded by limits checked *before* each
operation: expression length and nesting depth, the size of an exponent and of the integers it would
produce (``9**9**9`` is refused in microseconds instead of running for hours), and the result's magnitude.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from .base import ToolError

Number = int | float

MAX_EXPRESSION_CHARS = 300
MAX_DEPTH = 40  # AST nesting; also keeps the recursive walk far from Python's recursion limit
MAX_EXPONENT = 1000  # |b| in a ** b
MAX_INT_BITS = 1024  # any integer operand or result (~ 10**308, the float range)
MAX_FLOAT = 1e300


class CalculatorError(ToolError):
    """An expression :func:`evaluate` refuses or cannot compute; the message says why, for the model."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOL = {ast.BitXor: "^ (use ** for powers)", ast.BitAnd: "&", ast.BitOr: "|", ast.LShift: "<<", ast.RShift: ">>"}


def _log2(value: Number) -> float:
    """log2 of |value| (0 for 0); math.log2 handles ints of any size without converting them to float."""
    return math.log2(abs(value)) if value else 0.0


def _check_result(value: Any) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("the result is a complex number (e.g. a fractional power of a negative number)")
    if isinstance(value, int):
        if value.bit_length() > MAX_INT_BITS:
            raise CalculatorError(f"the result is too large (more than {MAX_INT_BITS} bits)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or abs(value) > MAX_FLOAT:
            raise CalculatorError("the result is too large or not a finite number")
        return value
    raise CalculatorError(f"unexpected result type {type(value).__name__}")


def _power(base: Number, exponent: Number) -> Number:
    # Refuse before computing: int ** int is exact and its cost grows with the result's size.
    # Float powers that overflow raise OverflowError at once; negative exponents give small floats.
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {exponent!r} is too large (limit {MAX_EXPONENT})")
    if exponent > 0 and _log2(base) * exponent > MAX_INT_BITS:
        raise CalculatorError(f"the power is too large (more than {MAX_INT_BITS} bits)")
    return base**exponent


def _evaluate(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise CalculatorError(f"the expression is nested too deeply (limit {MAX_DEPTH})")
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        # bool is an int subclass; True + 1 is not arithmetic the model should rely on
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
        return _check_result(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_result(_UNARY[type(node.op)](_evaluate(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp):
        if type(node.op) not in _BINARY:
            symbol = _SYMBOL.get(type(node.op), type(node.op).__name__)
            raise CalculatorError(f"the operator {symbol} is not supported")
        left = _evaluate(node.left, depth + 1)
        right = _evaluate(node.right, depth + 1)
        try:
            if isinstance(node.op, ast.Pow):
                return _check_result(_power(left, right))
            return _check_result(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    if isinstance(node, ast.Call):
        raise CalculatorError("function calls are not allowed (only numbers and + - * / // % ** and parentheses)")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"names are not allowed, got {node.id!r} (only numbers and operators)")
    if isinstance(node, ast.Attribute):
        raise CalculatorError("attribute access is not allowed")
    raise CalculatorError(
        f"unsupported syntax: {type(node).__name__} (only numbers and + - * / // % ** and parentheses)"
    )


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression in Python syntax, computed safely (see the module docstring).

    Raises :class:`CalculatorError` (a :class:`ToolError`) with a message meant for the model for anything
    outside the whitelist or the limits; never runs code and never raises anything else for any string.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    # common non-Python spellings models use; translating them is cheaper than a wasted turn
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("−", "-")
    if not text:
        raise CalculatorError("the expression is empty")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid syntax: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError):  # absurd nesting; ValueError: null bytes
        raise CalculatorError("the expression cannot be parsed") from None
    try:
        return _evaluate(tree, 0)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_result(value: Number) -> str:
    """The tool result text: ints exactly, floats by ``repr`` (shortest round-tripping form)."""
    return str(value) if isinstance(value, int) else repr(value)
