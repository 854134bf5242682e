"""fuse_norm_int8_quant: an RMSNorm whose output feeds int8 linears writes their int8 rows itself.

Runs only when the compile options ask for it (codegen.tuning LinearTuning.norm_int8: the pipeline's
knob-gated passes, ir/passes/__init__.py).
"""
from __future__ import annotations

import networkx as nx

from ..formats import WeightFormat
from .norm_rows import add_quant_rows


def _int8_per_token(fmts: list[WeightFormat]) -> bool:
    """Weights that quantise their input per token to int8 (msModelSlim's dynamic formats: int8_channel,
    the int4 ones): their reader would run quantize_activation on the norm's output."""
    return bool(fmts) and all(f.activation == "token" for f in fmts)


def fuse_norm_int8_quant(G: nx.DiGraph) -> nx.DiGraph:
    """Give every norm (rms_norm, fused_add_rms_norm, moe_combine_residual_rms_norm) with a reader whose
    weights quantise its input per token to int8 the quantised rows as two more outputs.

    before                                   after

      ... -> rms_norm (weight, eps)            ... -> rms_norm (weight, eps, quant: int8)
                |                                     /          |            \\
             h [T,D]                              h [T,D]   h.qi8 [T,qrow/4]  h.si8 [T]
            /       \\                              /    \\        (int32)        (fp32)
      linear (int8)  other readers          linear (int8) other readers

    h.qi8 / h.si8 are ir/formats_int.py quantized_rows(h): quantize_activation of the norm's output
    (rounded to the activation dtype first: the value h is), the int8 row zero padded to qrow(D) bytes,
    four a word -- exactly what the readers' own quantiser launch writes, so a reader may read them instead
    (codegen: linear_skinny, gemm_int8, the int experts) and the graph's results do not change.  The readers
    keep h as their input (their reference semantics quantise it themselves); h is still written for
    every other reader.  The same for fused_add_rms_norm (outputs h, s, then the rows) and
    moe_combine_residual_rms_norm.
    """
    return add_quant_rows(G, "int8", _int8_per_token)
