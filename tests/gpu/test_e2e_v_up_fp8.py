"""End to end on the GPU: Tuning.linear.v_up_fp8 (mla_v_up writes o_proj's e4m3 rows) changes who quantises o,
not a bit of the result.  test_e2e_fp8.py's tiny V2-Lite-style FP8 checkpoint with v_head_dim 128 (the knob needs
a head's V columns to be one 128-column group; V2-Lite's and V3's are), two cuda engines in bf16 (the knob off and
on; gemm_fp8 from 17 tokens, linear.fp8_chunks_upto = 0, so decode at b = 32 runs it): their logits are equal bit
for bit at paged decode over a batch of 32 sequences, prefill is the same plan, and the engine with the knob runs
the qf8 v_up launches and no o_proj quantiser at decode.
"""
from __future__ import annotations

import pytest
import torch

from test_e2e_fp8 import CONFIGS, TUNED, write_fp8_checkpoint

pytestmark = pytest.mark.gpu
DEV = "cuda"
BATCH = [[(5 * i + 3 * j) % 96 + 1 for j in range(12)] for i in range(32)]   # 32 prompts of 12 tokens
NAME = "v2_lite_v128"


def _config():
    config = CONFIGS["v2_lite"]()
    config.v_head_dim = 128   # o [T, 3 * 128]: o_proj's K = 384, three groups, one a head
    return config


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(cuda bf16 engine, the same with linear.v_up_fp8), both on the FP8 checkpoint."""
    from runtime import Engine
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(CONFIGS, NAME, _config)
        path = write_fp8_checkpoint(NAME, tmp_path_factory.mktemp("v_up_fp8"))
    kw = dict(device=DEV, block_size=5, num_blocks=256, max_seq_len=128, max_num_seqs=32)
    off = Engine.from_pretrained(path, backend="cuda", dtype=torch.bfloat16,
                                 tuning={**TUNED, "linear": {"fp8_chunks_upto": 0}}, **kw)
    on = Engine.from_pretrained(path, backend="cuda", dtype=torch.bfloat16,
                                tuning={**TUNED, "linear": {"fp8_chunks_upto": 0, "v_up_fp8": True}}, **kw)
    return off, on


def _names(engine, phase):
    return [getattr(s, "name", "") for s in engine.backend.plans[phase].steps]


def test_the_knob_runs_v_ups_rows_and_no_o_proj_quantiser(engines):
    off, on = engines
    assert _names(on, "prefill") == _names(off, "prefill")
    assert not any(n.startswith("mla_v_up") and n.endswith("__qf8") for n in _names(off, "decode"))
    assert any(n.startswith("mla_v_up") and n.endswith("__qf8") for n in _names(on, "decode"))
    quant = [n for n in _names(off, "decode") if n == "gemm_fp8__bf16__k384__quant_x"]
    assert quant and "gemm_fp8__bf16__k384__quant_x" not in _names(on, "decode")


def test_decode_logits_at_b32_equal_bit_for_bit(engines):
    """4 prompt tokens prefilled, then 8 decode steps of the 32 sequences together (T = 32: v_up's qf8 launch,
    o_proj's gemm_fp8 on its rows)."""
    off, on = engines
    for i, (mine, base) in enumerate(zip(on.logits(BATCH, decode_after=4), off.logits(BATCH, decode_after=4))):
        assert torch.equal(mine, base), f"sequence {i}: " \
            f"{((mine - base).norm() / base.norm()).item():.3g} from the knob-off logits"
