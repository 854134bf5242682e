"""Launch-geometry expressions: grid, shared memory, workspace shapes and "size:" args.

A family states them over the step's runtime sizes (T, B, NP, MAXQ, MAXCTX, TK and
any other name the caller supplies) and the device's (DEVICE_SIZES: SMS, the number
of streaming multiprocessors, which runtime.launcher.KernelRunner reads from the
device the step runs on); the runtime evaluates them just before a launch.  Only integers, names, + - * // ( ), unary minus and cdiv/max/min are
allowed: a launch plan is data, not a program, so there is no eval().
"""
from __future__ import annotations

import ast
import functools
import operator

STEP_SIZES = ("T", "B", "NP", "MAXQ", "MAXCTX", "TK")   # TK: the step's context rows (prefill)
# Facts of the device a launch runs on, supplied by the runtime at launch time (not part of
# the bundle's cache key: the generated code does not depend on them, only launch geometry).
DEVICE_SIZES = ("SMS",)

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_FUNCS = {"cdiv": _cdiv, "max": max, "min": min}


class SizeExprError(ValueError):
    """A size expression is malformed or uses a name it was not given."""


@functools.lru_cache(maxsize=4096)
def _parse(expr: str) -> ast.AST:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        raise SizeExprError(f"cannot parse size expression {expr!r}") from None
    _validate(tree.body, expr)
    return tree.body


def _validate(node: ast.AST, expr: str) -> None:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int):
            raise SizeExprError(f"only integer literals are allowed in {expr!r}, got {node.value!r}")
    elif isinstance(node, ast.Name):
        pass
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        _validate(node.left, expr)
        _validate(node.right, expr)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _validate(node.operand, expr)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in _FUNCS and not node.keywords and len(node.args) == 2):
        for a in node.args:
            _validate(a, expr)
    else:
        raise SizeExprError(f"unsupported syntax in size expression {expr!r} (allowed: integers, "
                            f"names, + - * // ( ), cdiv(a, b), max(a, b), min(a, b))")


def _walk(node: ast.AST, sizes: dict, expr: str) -> int:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        try:
            value = sizes[node.id]
        except KeyError:
            raise SizeExprError(f"size expression {expr!r} uses {node.id!r}; given: "
                                f"{', '.join(sorted(sizes)) or '(none)'}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SizeExprError(f"size {node.id!r} must be an int, got {value!r}")
        return value
    if isinstance(node, ast.BinOp):
        left, right = _walk(node.left, sizes, expr), _walk(node.right, sizes, expr)
        if isinstance(node.op, ast.FloorDiv) and right == 0:
            raise SizeExprError(f"division by zero in size expression {expr!r} ({sizes})")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp):
        return -_walk(node.operand, sizes, expr)
    a, b = (_walk(x, sizes, expr) for x in node.args)
    if node.func.id == "cdiv" and b == 0:
        raise SizeExprError(f"cdiv by zero in size expression {expr!r} ({sizes})")
    return _FUNCS[node.func.id](a, b)


def evaluate(expr, sizes: dict[str, int]) -> int:
    """An int, or an expression string over `sizes` -> int."""
    if isinstance(expr, bool):
        raise SizeExprError(f"expected an int or a size expression, got {expr!r}")
    if isinstance(expr, int):
        return expr
    if not isinstance(expr, str):
        raise SizeExprError(f"expected an int or a size expression, got {expr!r}")
    return _walk(_parse(expr), sizes, expr)


def names(expr) -> set[str]:
    """The size names an expression reads (for checking a plan before it runs)."""
    if isinstance(expr, int) and not isinstance(expr, bool):
        return set()
    return {n.id for n in ast.walk(_parse(expr)) if isinstance(n, ast.Name)} - set(_FUNCS)


def check(expr) -> None:
    """Raise SizeExprError if `expr` is not a well-formed size expression."""
    if isinstance(expr, int) and not isinstance(expr, bool):
        return
    if not isinstance(expr, str):
        raise SizeExprError(f"expected an int or a size expression, got {expr!r}")
    _parse(expr)


# -- grid factors: a launch that only runs in part of the token range -------------------------
# A family that serves one node with different kernels by the step's token count multiplies each
# launch's grid by one of these (0 / 1 expressions over T): exactly one form has work at each T,
# and the choice is made on the host from sizes it already knows (no sync; a captured decode
# graph holds only the launches with work).

def only_below(ts: int) -> str:
    """1 while T <= ts, else 0."""
    return f"(1 - min(1, T // {ts + 1}))"


def only_above(ts: int) -> str:
    """1 while T > ts, else 0."""
    return f"min(1, T // {ts + 1})"


def token_range(lo: int, hi: int | None) -> str | None:
    """1 while lo <= T <= hi (hi None: no end), else 0; None where that is every T >= 1."""
    if lo <= 1:
        return None if hi is None else only_below(hi)
    return only_above(lo - 1) if hi is None else f"{only_above(lo - 1)} * {only_below(hi)}"


def token_ranges(ranges) -> str | None:
    """1 while T lies in one of `ranges` ((lo, hi) pairs that do not overlap), else 0."""
    factors = [token_range(lo, hi) for lo, hi in ranges]
    if any(f is None for f in factors):
        return None
    return factors[0] if len(factors) == 1 else "(" + " + ".join(factors) + ")"
