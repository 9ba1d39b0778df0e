"""``calculator``: the arithmetic tasks with a ``calc`` tool, so the policy may compute instead of guessing
digits (``[calc 17+23*4-8]`` -> ``{101}``)."""
from __future__ import annotations

import ast
import operator
from dataclasses import dataclass

from codraft.envs.base import Environment
from codraft.tasks import Task

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calc(expression: str) -> str:
    """An arithmetic expression's value as text (integers stay integers); a malformed one is an error text
    the policy reads (its mistake, not the environment's)."""
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
        return f"error: {type(e).__name__}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _eval(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Mult) and abs(left) * abs(right) > 10**18:
            raise OverflowError("too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("not arithmetic")


@dataclass
class Calculator(Environment):
    name = "calculator"
    task: Task

    def __post_init__(self):
        self.tools = {"calc": calc}
