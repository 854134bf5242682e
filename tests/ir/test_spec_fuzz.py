"""Hypothesis: random mutations of a valid spec give either a valid spec (whose two phase
graphs build and verify) or an ir.SpecError naming the file, a YAML path that exists in the
mutated document, and the line of that path; never another exception type."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ir import SpecError, build_graph, load_spec, verify
from ir.ops import OPS

BASE_TEXT = (Path(__file__).resolve().parents[2] / "model_specs" / "deepseek_v2_lite.yaml").read_text()
BASE = yaml.safe_load(BASE_TEXT)
FILE = "mutated.yaml"
EXAMPLES = int(os.environ.get("DSGRAPH_FUZZ_EXAMPLES", "120"))
RANDOM = bool(os.environ.get("DSGRAPH_FUZZ_RANDOM"))   # set it for a longer, randomised campaign

REF_KEYS = ("in", "out", "inputs", "outputs")   # entries that name values


def _walk(node, prefix=()):
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _walk(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, prefix + (i,))


def _parent(data, path):
    node = data
    for part in path[:-1]:
        node = node[part]
    return node


def _is_scalar(v):
    return not isinstance(v, (dict, list))


def _ops(data):
    """Paths of every op mapping: ('blocks', name, 'ops', i)."""
    return [p for p, v in _walk(data) if len(p) == 4 and p[0] == "blocks" and p[2] == "ops" and isinstance(v, dict)]


def _refs(data):
    """Paths of value names: an op's in/out (or one item of them) and a block's inputs/outputs items."""
    out = []
    for p, v in _walk(data):
        if not isinstance(v, str) or p[:1] != ("blocks",):
            continue
        if (len(p) >= 2 and p[-1] in REF_KEYS) or (len(p) >= 2 and isinstance(p[-1], int) and p[-2] in REF_KEYS):
            out.append(p)
    return out


OTHER_VALUES = st.one_of(
    st.text(max_size=12),
    st.integers(min_value=-10**6, max_value=-1),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
OP_NAMES = st.sampled_from(sorted(OPS) + ["call", "matmul", "Linear", "", "linear "])
IDENT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)


def _mutate(data, draw):
    kind = draw(st.sampled_from(["delete_key", "replace_scalar", "rename_op", "rename_value", "drop_op"]))
    if kind == "delete_key":
        keys = [p for p, _ in _walk(data) if p and isinstance(p[-1], str)]
        path = draw(st.sampled_from(keys))
        del _parent(data, path)[path[-1]]
    elif kind == "replace_scalar":
        leaves = [p for p, v in _walk(data) if p and _is_scalar(v)]
        path = draw(st.sampled_from(leaves))
        old = _parent(data, path)[path[-1]]
        new = draw(OTHER_VALUES.filter(lambda v: type(v) is not type(old) or isinstance(v, str)))
        _parent(data, path)[path[-1]] = new
    elif kind == "rename_op":
        ops = _ops(data)
        if ops:
            path = draw(st.sampled_from(ops))
            _parent(data, path)[path[-1]]["op"] = draw(OP_NAMES)
    elif kind == "rename_value":
        refs = _refs(data)
        if refs:
            path = draw(st.sampled_from(refs))
            names = sorted({v for p, v in _walk(data) if p in refs})
            _parent(data, path)[path[-1]] = draw(st.one_of(st.sampled_from(names), IDENT))
    else:  # drop_op
        ops = _ops(data)
        if ops:
            path = draw(st.sampled_from(ops))
            del _parent(data, path)[path[-1]]
    return kind


def _resolve(data, path: str):
    """Follow a SpecError path ("blocks.mla.ops[3].in[1]") into the data; KeyError/IndexError if absent."""
    node = data
    if not path:
        return node
    for key, index in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path):
        node = node[int(index)] if index else node[key]
    return node


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.data())
def test_mutated_spec_is_valid_or_a_located_spec_error(data):
    spec_data = yaml.safe_load(BASE_TEXT)
    kinds = [_mutate(spec_data, data.draw) for _ in range(data.draw(st.integers(1, 3)))]
    text = yaml.safe_dump(spec_data, sort_keys=False)
    try:
        spec = load_spec(text, file=FILE)
    except SpecError as err:
        msg = str(err)
        assert err.file == FILE and msg.startswith(FILE + ":"), msg
        assert isinstance(err.line, int) and 1 <= err.line <= text.count("\n") + 1, msg
        if err.path:
            assert f" at {err.path}: " in msg, msg
        located = yaml.safe_load(text)
        try:
            node = _resolve(located, err.path)
        except (KeyError, IndexError, TypeError):
            raise AssertionError(f"{msg}\n(path {err.path!r} is not in the mutated spec; mutations {kinds})") from None
        last = re.findall(r"[^.\[\]]+|\[\d+\]", err.path)[-1] if err.path else ""
        if last and not last.startswith("[") and not isinstance(node, (dict, list)):
            line_text = text.splitlines()[err.line - 1]
            assert f"{last}:" in line_text, f"{msg}\nline {err.line} is {line_text!r}"
        return
    for phase in ("prefill", "decode"):
        verify(build_graph(spec, phase))


def test_unmutated_dump_loads():
    load_spec(yaml.safe_dump(BASE, sort_keys=False), file=FILE)
