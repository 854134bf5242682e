"""fuse_norm_fp8_quant: an RMSNorm whose output feeds FP8 x FP8 GEMMs writes their e4m3 rows itself.

Runs only when the compile options ask for it (codegen.tuning LinearTuning.norm_fp8: the pipeline's
knob-gated passes, ir/passes/__init__.py).
"""
from __future__ import annotations

import networkx as nx

from ..formats import FP8, WeightFormat
from .norm_rows import add_quant_rows


def all_fp8(fmts: list[WeightFormat]) -> bool:
    """Weights all in DeepSeek-V3's FP8 blocks: above the skinny range their reader quantises its input per
    token per 128 columns to e4m3 (ir/act_quant.py quantize_act_fp8) before the FP8 x FP8 GEMM."""
    return bool(fmts) and all(f is FP8 for f in fmts)


def _width_problem(n: int) -> str | None:
    """The FP8 GEMMs take rows of whole 16-byte chunks (gemm_fp8.serves, the grouped experts' fp8_rows)."""
    return None if n % 16 == 0 else f"the FP8 GEMMs read rows of whole 16-byte chunks; the norm's width {n} is not"


def fuse_norm_fp8_quant(G: nx.DiGraph) -> nx.DiGraph:
    """Give every norm (rms_norm, fused_add_rms_norm, moe_combine_residual_rms_norm) with a reader whose
    weights are all FP8 the e4m3 rows of its output as two more outputs.

    before                                   after

      ... -> rms_norm (weight, eps)            ... -> rms_norm (weight, eps, quant: fp8)
                |                                     /          |              \\
             h [T,D]                              h [T,D]   h.qf8 [T,D/4]   h.sf8 [T,ceil(D/128)]
            /       \\                              /    \\       (int32)          (fp32)
      linear (FP8)   other readers           linear (FP8) other readers

    h.qf8 / h.sf8 are ir/act_quant.py quantize_act_fp8(h) (h already rounded to the activation dtype), the
    e4m3 bytes four a word: what the FP8 x FP8 readers' own quantiser launch writes, so they may read them
    instead (codegen: gemm_fp8, the grouped experts' gate_up; where and at which token counts the norm's
    kernel writes them is the lowering's choice) and the graph's results do not change.  The readers keep h
    as their input; h is still written for every other reader and for the skinny range, where the FP8
    kernels read 16-bit x.  Refused (logged) where D % 16 != 0: the FP8 GEMMs do not take such rows.
    """
    return add_quant_rows(G, "fp8", all_fp8, _width_problem)
