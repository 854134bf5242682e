"""End to end on the GPU: Tuning.linear.norm_fp8 (the RMSNorms write their FP8 x FP8 readers' e4m3 rows) changes
who quantises the norms' outputs, not a bit of the result.  The tiny V3- and V2-Lite-style FP8 checkpoints of
tests/gpu/test_e2e_fp8.py, two cuda engines in bf16 on each (the knob off and on, the experts' FP8 x FP8 GEMMs
from 17 tokens as there): their logits are equal bit for bit at prefill (one prompt of 22 tokens with two short
ones: T = 30; 32 prompts: T = 384) and at paged decode over a batch of 32 sequences (gemm_fp8 at T = 32 reads
the norms' rows), and the engine with the knob runs the norms' qf8 launches and fewer quantisers.
"""
from __future__ import annotations

import pytest
import torch

from test_e2e_fp8 import CONFIGS, PROMPTS, TUNED, write_fp8_checkpoint

pytestmark = pytest.mark.gpu
DEV = "cuda"
BATCH = [[(7 * i + 3 * j) % 96 + 1 for j in range(12)] for i in range(32)]   # 32 prompts of 12 tokens


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engines(request, tmp_path_factory):
    """(name, cuda bf16 engine, the same with linear.norm_fp8), both on the FP8 checkpoint."""
    from runtime import Engine
    name = request.param
    path = write_fp8_checkpoint(name, tmp_path_factory.mktemp(f"norm_fp8_{name}"))
    kw = dict(device=DEV, block_size=5, num_blocks=256, max_seq_len=128, max_num_seqs=32)
    # gemm_fp8 from 17 tokens (the FP8 skinny kernel's 16-token chunks read the 16-bit x, not the norms' rows)
    off = Engine.from_pretrained(path, backend="cuda", dtype=torch.bfloat16,
                                 tuning={**TUNED, "linear": {"norm_fp8": False, "fp8_chunks_upto": 0}}, **kw)
    on = Engine.from_pretrained(path, backend="cuda", dtype=torch.bfloat16,
                                tuning={**TUNED, "linear": {"norm_fp8": True, "fp8_chunks_upto": 0}}, **kw)
    return name, off, on


def _stages(engine, phase):
    return [(getattr(s, "name", ""), getattr(s, "stage", "")) for s in engine.backend.plans[phase].steps]


def test_the_knob_runs_the_norms_rows_and_fewer_quantisers(engines):
    _, off, on = engines
    for phase in ("prefill", "decode"):
        assert not any(n.endswith("__qf8") for n, _ in _stages(off, phase)), phase
        assert any(n.endswith("__qf8") for n, _ in _stages(on, phase)), phase
        quant_off = sum(st == "quant_x" for _, st in _stages(off, phase))
        quant_on = sum(st == "quant_x" for _, st in _stages(on, phase))
        assert quant_on < quant_off, (phase, quant_on, quant_off)


def test_prefill_logits_equal_bit_for_bit(engines):
    name, off, on = engines
    for prompts in (PROMPTS, BATCH):
        for i, (mine, base) in enumerate(zip(on.logits(prompts), off.logits(prompts))):
            assert torch.equal(mine, base), f"{name} prompt {i} of {len(prompts)}: " \
                f"{((mine - base).norm() / base.norm()).item():.3g} from the knob-off logits"


def test_decode_logits_at_b32_equal_bit_for_bit(engines):
    """4 prompt tokens prefilled, then 8 decode steps of the 32 sequences together (T = 32: gemm_fp8)."""
    name, off, on = engines
    for i, (mine, base) in enumerate(zip(on.logits(BATCH, decode_after=4), off.logits(BATCH, decode_after=4))):
        assert torch.equal(mine, base), f"{name} sequence {i}: " \
            f"{((mine - base).norm() / base.norm()).item():.3g} from the knob-off logits"
