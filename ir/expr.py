"""Tiny arithmetic over named dims: "heads * (qk_nope_head_dim + qk_rope_head_dim)".

Only integers, names, + - * // and parentheses: a spec states shapes, it is not
a program. Anything else is rejected with a message the SpecError can carry.
"""
from __future__ import annotations

import ast
import operator

from .errors import did_you_mean

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


class ExprError(ValueError):
    pass


def evaluate(expr, env: dict[str, int | None]) -> int:
    """Evaluate an int or a dim expression against ``env`` (dim name -> int)."""
    if isinstance(expr, bool):
        raise ExprError(f"expected a dim expression, got {expr!r}")
    if isinstance(expr, int):
        return expr
    if not isinstance(expr, str):
        raise ExprError(f"expected a dim expression, got {expr!r}")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise ExprError(f"cannot parse dim expression {expr!r}") from None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in env:
                raise ExprError(f"undefined dim {node.id!r} in {expr!r}{did_you_mean(node.id, env)}")
            value = env[node.id]
            if value is None:
                raise ExprError(f"dim {node.id!r} is null (this model has none) but {expr!r} uses it")
            return value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ExprError(f"division by zero in dim expression {expr!r}")
            return _BINOPS[type(node.op)](left, right)
        raise ExprError(f"unsupported syntax in dim expression {expr!r} (only + - * // and names)")

    return walk(tree)
