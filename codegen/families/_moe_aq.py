"""Whether gate_up_silu's FP8 x FP8 epilogue hands down its e4m3 activations (Tuning.moe.fp8_act_epilogue,
templates/include/moe_gemm_fp8.cuh AQ): a's storage then holds a's e4m3 rows and per-128-column scales
instead of the 16-bit a, and down's FP8 x FP8 GEMM reads them there without its quantiser launch.

That holds only where the two ends agree at every token count: both run the FP8 x FP8 GEMM (the
"wgmma_fp8" row of codegen/dispatch.py's grouped_experts table) over exactly the same token ranges
(below them both read and write the 16-bit a), a's width is whole 16-byte chunks of e4m3, and nothing
but down reads a.  Two places pair them: moe_expert_ffn's two-launch path (its a is the node's
workspace) and prefill's moe_gate_up_silu -> moe_down (a is a graph value read by that down alone).

Not a family (the leading underscore).
"""
from __future__ import annotations

from codegen import dispatch
from ir.passes.rewrite import op_of, producer_of, sole_reader

from . import _moe_gemm_fp8, _moe_grouped


def hands_off(opts, gu: dict, dn: dict) -> bool:
    """gate_up_silu's (gu) and down's (dn) grouped params: the hand-off applies (module docstring)."""
    if not (opts.tuning.moe.fp8_act_epilogue and gu.get("fp8") and dn.get("fp8")) or gu["N"] % 16:
        return False
    rows_gu = dispatch.row_range(_moe_grouped.table_rows(opts, gu, down=False), _moe_gemm_fp8.VARIANT)
    rows_dn = dispatch.row_range(_moe_grouped.table_rows(opts, dn, down=True), _moe_gemm_fp8.VARIANT)
    return bool(rows_gu) and rows_gu == rows_dn


def pair(G, nid: str) -> tuple[str, str] | None:
    """(moe_gate_up_silu, moe_down) nodes of prefill's pair through `nid` (either), or None: down is a's
    only reader, as its input 0, over the same routing."""
    data = G.nodes[nid]
    if data["op"] == "moe_gate_up_silu":
        gu, (a,) = nid, data["outputs"]
        dn = sole_reader(G, gu, a)
    else:
        dn, a = nid, data["inputs"][0]
        gu = producer_of(G, dn, a)
        if op_of(G, gu) != "moe_gate_up_silu" or sole_reader(G, gu, a) != dn:
            return None
    if op_of(G, dn) != "moe_down" or list(G.nodes[dn]["inputs"]) != [a, G.nodes[gu]["inputs"][1]]:
        return None
    return gu, dn


def prefill_hands_off(G, nid: str, opts) -> bool:
    """hands_off for the moe_gate_up_silu or moe_down node `nid` and its partner (`pair`)."""
    if not opts.tuning.moe.fp8_act_epilogue:
        return False
    both = pair(G, nid)
    if both is None:
        return False
    from . import moe_down, moe_gate_up_silu    # they import this module
    return hands_off(opts, moe_gate_up_silu.params(both[0], G, opts), moe_down.params(both[1], G, opts))
