"""moe_combine_residual_rms_norm's streaming launches (Tuning.moe.combine_stream_above): above that many
tokens, CTAs as many as the SMs hold at once (`cps` an SM), each serving every gridDim-th token, with the
next token's rows copied into shared memory (16-byte cp.async, templates/include/moe_combine_stream.cuh)
while the current one's norm reduces.  One CTA a token (the plain launch) waits on its loads and then on
its block reductions with nothing in flight; here an SM keeps a token's rows a CTA in flight throughout.
The plain launches keep T up to the knob (decode's).  Same rows, layout, sums and reduction order as the
plain kernel: the same bits.

Not a family (the leading underscore): moe_combine_residual_rms_norm's launch geometry only.
"""
from __future__ import annotations

from codegen.sizes import only_above, only_below

from .mla_decode_attention import smem_limit
from .segment import CTA_RESERVED_SMEM, SM_SMEM

TEMPLATE = "moe_combine_residual_rms_norm_stream.cu.j2"
NAME = "st"                 # the kernel-name part
CTA_SMEM_MAX = smem_limit("sm_90a")     # a CTA's dynamic shared memory at most (227 KB), of SM_SMEM an SM
CTA_RESERVED = CTA_RESERVED_SMEM + 1024  # what the driver reserves a CTA, and the kernel's static shared memory
REGS_A_THREAD = 64          # the register budget the CTAs an SM (cps) leave each thread: 65536 / 64 threads


def stage_bytes(D: int, K: int, S: int, elem: int) -> int:
    """A token's rows in shared memory: K pair rows, the shared row (S == 0), the residual."""
    return (K + (1 if S else 2)) * D * elem


def plan(p: dict, elem: int) -> dict | None:
    """The streaming launch's parameters (cps: CTAs an SM; smem: the stage's bytes), None where it cannot
    run: rows not of whole 16-byte slices, or a stage over a CTA's shared memory."""
    D, K, S, threads = p["D"], p["K"], p["S"], p["threads"]
    smem = stage_bytes(D, K, S, elem)
    if (D * elem) % 16 or smem + CTA_RESERVED > CTA_SMEM_MAX:
        return None
    cps = max(1, min(2048 // threads, 65536 // (threads * REGS_A_THREAD), SM_SMEM // (smem + CTA_RESERVED)))
    return {"cps": cps, "smem": smem}


def grid(stream: dict, factor: str | None) -> str:
    """CTAs the SMs hold at once (fewer at fewer tokens), times the launch's token-range factor."""
    g = f"min(T, SMS * {stream['cps']})"
    return g if factor is None else f"{g} * {factor}"


def _and(factor: str | None, other: str) -> str:
    return other if factor is None else f"{factor} * {other}"


def launches(G, p: dict, elem: int, opts, make, norm_launches) -> list:
    """The node's launches: norm_launches(make) (the plain ones, _norm_quant's split by quantised rows)
    at every T where the knob is off, in a decode plan, or where the stream cannot run; else those up to
    the knob's T and the same split of streaming launches above it.  Decode plans keep the plain launch
    alone: a stream gains only past SMS x cps tokens (a token a CTA below), and a launch that is no
    persistent-segment member would end a segment's run there (codegen/segments.py find)."""
    above = opts.tuning.moe.combine_stream_above
    stream = None if above is None or G.graph.get("phase") == "decode" else plan(p, elem)
    if stream is None:
        return norm_launches(make)
    plain = [] if above == 0 else norm_launches(lambda qp, qn, qa, f: make(qp, qn, qa, _and(f, only_below(above))))
    return plain + norm_launches(lambda qp, qn, qa, f: make(qp, qn, qa, _and(f, only_above(above)), stream))
