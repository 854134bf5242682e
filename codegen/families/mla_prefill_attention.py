"""mla_prefill_attention: flash-style causal attention of each sequence's new tokens over its
decompressed keys ([kv_nope | k_rot], N + R wide) and values (V wide); fp32 online softmax.  A
sequence's keys start at key_start[b] (its whole context: mla_gather_context's rows, decompressed)
or, with keys "step", at its queries' own rows; the causal bound shifts by the keys before its
first query (a cached prefix).  Grid: (query tiles of the longest query, heads, sequences).

bf16 / fp16: tensor cores, mma.sync m16n8k16: MlaPrefillTC2 (mla_prefill_tc2.cuh; Q in registers,
a two-stage K / V ring, the mask only on tiles that need it) at the tile Tuning.attention.prefill_tile
names, by default 64-row query tiles of 4 warps.  fp32: CUDA cores (MlaPrefill, mla_prefill.cuh: 32-row query tiles,
256 threads).

Alignment: the fp32 kernel reads and writes global memory element by element. The tensor-core
kernel copies 16-byte chunks by cp.async only when N, R and V are multiples of 8 (compile time)
and every base pointer is 16-byte aligned and every row / head stride a multiple of 8 elements
(checked once per CTA); otherwise it gathers elements and stores whole 16-byte chunks to shared
rows whose pitch is a multiple of 8 halves. Its output (a fresh contiguous buffer) takes 4-byte
pair stores at even columns when V is even."""
from __future__ import annotations

import re
from typing import NamedTuple

from codegen.kernel import KernelLaunch, ctx, inp, out, stride
from codegen.render import kernel_name

from ._dense_util import LoweringError, act_ctype, c_float, dims, inner_dims, node_io
from .mla_decode_attention import check_smem

FAMILY = "mla_prefill_attention"
TEMPLATE = "mla_prefill_attention.cu.j2"
OPS = ("mla_prefill_attention",)
PDL = True    # its kernels keep the contract of templates/include/pdl.cuh (programmatic dependent launch)

# Where a sequence's keys start (ir/ops/attention.py MlaPrefillAttention's keys): its own tokens
# (the queries' rows) or its whole context (mla_gather_context's rows, packed at key_start).
KEY_ROWS = {"step": "query_start", "context": "key_start"}

BM = BN = 32
THREADS = 256
# The tile bf16 / fp16 lower to (Tuning.attention.prefill_tile; the default measured fastest at
# 1x2048 on the H200):
#   "v2_m{BM}n{BN}w{WM}{q|s}[b{B}]"
#                                MlaPrefillTC2 with BM query rows a CTA, BN keys a tile, WM (16 or 32)
#                                rows a warp, Q fragments in registers (q) or re-read from shared memory (s);
#                                b{B}: __launch_bounds__(THREADS, B), registers capped so B CTAs fit an SM
# The kernel name carries the full v2_m..n..w.. form, so each tile compiles to its own kernel.
_TC2 = re.compile(r"v2_m(\d+)n(\d+)w(16|32)([qs])(?:b(\d+))?")


class Tc2Tile(NamedTuple):
    bm: int        # query rows a CTA
    bn: int        # keys a K / V tile
    wm: int        # query rows a warp (16 or 32)
    qreg: bool     # Q fragments in registers for the CTA's life
    minb: int = 0  # CTAs an SM that __launch_bounds__ asks the register allocation to allow (0: no ask)

    @property
    def name(self) -> str:
        return f"v2_m{self.bm}n{self.bn}w{self.wm}{'q' if self.qreg else 's'}{f'b{self.minb}' if self.minb else ''}"

    @property
    def threads(self) -> int:
        return self.bm // self.wm * 32


def tc_variant(name: str) -> Tc2Tile:
    """The tile a prefill_tile setting names; a spelling it cannot be raises."""
    m = _TC2.fullmatch(name)
    if not m:
        raise LoweringError(f"attention.prefill_tile {name!r}: expected 'v2_m<BM>n<BN>w<16|32><q|s>'")
    tile = Tc2Tile(int(m[1]), int(m[2]), int(m[3]), m[4] == "q", int(m[5] or 0))
    if tile.bm % tile.wm or tile.bn % 16 or tile.bn == 0 or not 32 <= tile.threads <= 1024:
        raise LoweringError(f"attention.prefill_tile {name!r}: BM must be a multiple of WM with "
                            f"1 to 32 warps, BN a multiple of 16")
    return tile


def smem_bytes(N: int, R: int, V: int) -> int:
    dk = (N + R) | 1
    return (BM * dk + BN * dk + BN * (V | 1) + BM * (BN + 1)) * 4


def tc2_smem_bytes(N: int, R: int, V: int, tile: Tc2Tile) -> int:
    """MlaPrefillTC2::SMEM: [region 0 | stage 0], a stage = a K tile and a V tile; region 0 holds Q,
    then the second stage (over Q when Q's fragments move to registers, after it otherwise)."""
    qkp, vpp = -(-(N + R) // 16) * 16 + 8, -(-V // 16) * 16 + 8
    q, stage = tile.bm * qkp, tile.bn * (qkp + vpp)
    return ((max(q, stage) if tile.qreg else q + stage) + stage) * 2


def lower(nid, G, opts):
    data, ins, outs, w = node_io(G, nid)
    H, N = inner_dims(G, ins[0])
    _, R = inner_dims(G, ins[1])
    V = dims(G)["v_head_dim"]
    tc = opts.dtype in ("bf16", "fp16")
    tile = tc_variant(opts.tuning.attention.prefill_tile) if tc else None
    smem = tc2_smem_bytes(N, R, V, tile) if tile else smem_bytes(N, R, V)
    check_smem(f"mla_prefill_attention (N {N}, R {R}, V {V}, {opts.dtype})", smem, opts,
               "qk_nope_head_dim + qk_rope_head_dim and v_head_dim are too wide for one query / key / value tile")
    bm, threads = (tile.bm, tile.threads) if tile else (BM, THREADS)
    params = {"act": act_ctype(opts), "H": H, "N": N, "R": R, "V": V, "smem": smem,
              "scale": c_float(G.graph["model"].softmax_scale)}
    if tile:
        params["tc2"] = {**tile._asdict(), "name": tile.name}
    act = params["act"]
    parts = [opts.dtype, f"h{H}_n{N}_r{R}_v{V}", *(["mma"] if tc else []), *([tile.name] if tile else [])]
    return [KernelLaunch(
        family=FAMILY, template=TEMPLATE, name=kernel_name(FAMILY, parts),
        params=params, nodes=(nid,), grid=(f"cdiv(MAXQ, {bm})", H, "B"), block=(threads, 1, 1), smem=smem,
        args=(inp("q_nope", act, ins[0]), stride("qn_s0", ins[0], 0), stride("qn_s1", ins[0], 1),
              inp("q_rot", act, ins[1]), stride("qr_s0", ins[1], 0), stride("qr_s1", ins[1], 1),
              inp("kv", act, ins[2]), stride("kv_s0", ins[2], 0),
              inp("k_rot", act, ins[3]), stride("kr_s0", ins[3], 0),
              ctx("query_start", "query_start"), ctx("key_start", KEY_ROWS[data["attrs"]["keys"]]),
              ctx("positions", "positions"), out("out", act, outs[0])))]
