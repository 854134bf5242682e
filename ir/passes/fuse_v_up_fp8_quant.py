"""fuse_v_up_fp8_quant: decode's V up-projection writes the e4m3 rows of its output for o_proj's FP8 x FP8 GEMM.

Runs only when the compile options ask for it (codegen.tuning LinearTuning.v_up_fp8: the pipeline's knob-gated
passes, ir/passes/__init__.py).
"""
from __future__ import annotations

import networkx as nx

from ..formats import FP8_BLOCK
from .fuse_norm_fp8_quant import all_fp8
from .norm_rows import give_rows, x_formats
from .rewrite import RewriteError, copy_graph, nodes_of, readers_of, refuse


def fuse_v_up_fp8_quant(G: nx.DiGraph) -> nx.DiGraph:
    """Give every mla_v_up whose output o feeds a reader with all-FP8 weights (o_proj) o's e4m3 rows and
    per-128-column scales as two more outputs, where a head's V columns are exactly one 128-column group.

    before                                       after

      mla_decode_attention -> mla_v_up (kv_b)      mla_decode_attention -> mla_v_up (kv_b, quant: fp8)
                                 |                                 /            |              \\
                              o [T,H*V]                        o [T,H*V]  o.qf8 [T,H*V/4]  o.sf8 [T,H]
                                 |                                 |          (int32)         (fp32)
                            linear (FP8)                      linear (FP8)

    o.qf8 / o.sf8 are ir/act_quant.py quantize_act_fp8(o) (o already rounded to the activation dtype): what
    o_proj's own quantiser launch writes, so it may read them instead (codegen: gemm_fp8; the kernel that
    writes them holds a head's whole 128 columns of a token, so a group's max needs no other CTA) and the
    graph's results do not change.  o is still written (o_proj's skinny kernels below the GEMM's range read
    it).  Refused (logged) where V != 128: a group would span two heads or part of one.
    """
    G = copy_graph(G)
    for vup in nodes_of(G, "mla_v_up"):
        data = G.nodes[vup]
        o = data["outputs"][0]
        takers = [r for r in readers_of(G, vup, o) if all_fp8(x_formats(G, r, o))]
        if not takers or data["attrs"].get("quant") is not None:
            continue
        V = G.graph["model"].dims["v_head_dim"]
        if V != FP8_BLOCK:
            refuse(G, vup, takers[0], f"a 128-column group of o is not one head's V columns (V = {V})")
            continue
        try:
            give_rows(G, vup, "fp8")
        except RewriteError as exc:
            refuse(G, vup, takers[0], str(exc))
    return G
