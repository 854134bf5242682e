"""bench/perf_combine.py on the CPU: for each model it times the plain launch (a CTA a token) against the
streaming one of the same node, the same rows and bindings; its byte count is V2-Lite's prefill combine's."""
from __future__ import annotations

import pytest

from bench import perf_combine as pc


@pytest.mark.parametrize("model", sorted(pc.MODELS))
@pytest.mark.parametrize("rows", [None, "int8", "fp8"])
def test_the_bench_times_the_plain_launch_against_the_stream(model, rows):
    G, nid, types, (plain, stream) = pc.launches(model, rows)
    assert "stream" not in plain.params and stream.name == plain.name + "__st" and stream.args == plain.args
    assert plain.grid == ("T", 1, 1)


def test_the_byte_count_is_the_prefill_combines():
    G, nid, types, _ = pc.launches("v2_lite", "fp8")
    # a token: 8 pair rows + the residual read, s and h written (2048 bf16 each), 2048 e4m3 bytes and 16 scales,
    # 8 routing weights; and the norm's weight once
    assert pc.token_bytes(G, nid, types, 16384) == 16384 * (11 * 4096 + 2048 + 64 + 32) + 4096
