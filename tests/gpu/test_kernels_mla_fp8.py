"""Property tests: the absorbed MLA decode projections with kv_b in FP8 (fp8_e4m3_block128:
float8_e4m3fn bytes and a float32 scale per 128 x 128 block; templates/include/mla_absorb_fp8.cuh) --
mla_q_absorb, mla_decode_query, mla_decode_prologue and mla_v_up -- against the ops' reference
semantics from the same FP8 bytes and scales: kv_b dequantised exactly in float32 and cast to the
activation dtype, as the reference backend hands it to the op (ir/interpret.py bound_weight), the
rest in float64 on the kernel's own rounded inputs.  The kernel's weights are those values bit for
bit, so the tolerance is the 16-bit one of every absorbed-projection test (harness.STRICT).

Hypothesis draws the model (V2-Lite's and V3's dims, and small ones whose heads straddle the
128-row scale blocks and whose C ends in a partial "ceil" column block), the token count (tile
edges), bf16 / fp16, strided views at odd offsets, and an FP8 kv_b that is not 4 / 8-byte aligned
(the byte-load fall-backs).  Weight bytes span e4m3's range and the block scales differ up to 16x
from block to block, so a scale taken from a wrong block moves the result far past the tolerance.
Outputs are poisoned (NaN) first.  The planted mutants of tests/gpu/test_mutants.py (a column block's
scale swapped with its neighbour's, rows past a head's row-block edge scaled with the block before,
the ceil column block dropped) run through these bodies and must fail them."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import make_ctx, shifted, step_sizes, tiny_model
from kernel_cases import ROOT, Recorder, act, empty_out, kernel_test, reference, run_kernel, single_op_graph
from test_kernels_linear_fp8 import quantized
from test_kernels_mla import (LEAD, TOKEN_EDGES, absorb_out, dims, head_views, query_lens, row_views, split_tokens,
                              token_counts)
from test_kernels_mla import shifted as shifted_view

import ir
from ir.formats import FP8, set_format
from ir.interpret import bound_weight

SETTINGS = kernel_test(25)
DTYPES = ("bf16", "fp16")
OPS = ("mla_q_absorb", "mla_decode_query", "mla_decode_prologue", "mla_v_up")
RECS = {op: Recorder(f"{op} fp8") for op in OPS}
rope_layout = st.sampled_from([("adjacent", "interleaved"), ("halves", "halves"), ("adjacent", "halves")])

# The models (every one on the tensor-core kernels: N % 16 == 0, N <= 128, C % 32 == 0):
#   lite:  V2-Lite (H 16, N 128, V 128, C 512): a head's W_UK and W_UV one row block each, 4 column blocks.
#   v3:    V3's dims (H 128): 32768 rows of kv_b.
#   x128:  H 3, N 128, V 40, C 96: 168 rows a head, so heads 1 and 2 start inside a row block and their
#          W_UK rows straddle two (the query's second scale); C one partial column block.
#   tc16:  H 3, N 16, V 120, C 160: 136 rows a head, W_UV rows straddling row blocks (v_up's rows g and
#          g + 8 in two blocks), a ceil column block of 32; v_up in two k slices, the last one short.
#   tc32:  H 3, N 32, V 24, C 64: a thread's k16 steps across a row-block edge in head 2 (rows 112 ..).
MODELS = {
    "v3": None,
    "x128": dict(hidden=48, heads=3, kv_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=128, v_head_dim=40,
                 intermediate=40, moe_intermediate=16),
    "tc16": dict(hidden=40, heads=3, kv_lora_rank=160, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=120,
                 intermediate=40, moe_intermediate=16),
    "tc32": dict(hidden=48, heads=3, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
                 intermediate=40, moe_intermediate=16),
}
NAMES = ("lite", *MODELS)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for r in RECS.values():
        r.report()


@functools.lru_cache(maxsize=None)
def model(name: str):
    if name == "lite":
        return ir.load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml")).model
    if name == "v3":
        return ir.load_spec(str(ROOT / "model_specs" / "deepseek_v3.yaml")).model
    return tiny_model(**MODELS[name])


def fp8_kv_b(G, m, gen, misaligned: bool, x: torch.Tensor) -> tuple[dict, dict]:
    """(the kernel's weights: kv_b's FP8 bytes "kvb" and its scales "kvb_scale_inv"; the reference's: kv_b as
    the reference backend takes it, dequantised in float32 and cast to x's dtype).  kv_b is stored FP8 in G."""
    H, C, R, N, V = dims(m)
    set_format(G.graph["weights"], "kvb", FP8)
    q, s = quantized(H * (N + V), C, gen, 0.1)
    kernel = {"kvb": shifted(q, misaligned), "kvb_scale_inv": s}
    return kernel, {"kvb": bound_weight(G, {"kvb": q, "kvb_scale_inv": s}, "kvb", [x])}


def check_query(name, dtype, absorb, lens, layout, lead, misaligned, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(lens, [n + 40 for n in lens], block_size=64, model=m, dtype=getattr(torch, {
        "bf16": "bfloat16", "fp16": "float16"}[dtype]), ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    T = step.num_tokens
    q_nope, q_pe = head_views(T, H, [N, R], dtype, gen, lead)
    if absorb:
        G, nid = single_op_graph(m, "mla_q_absorb", {}, {"q_nope": act(H, N)}, {"kv_b": "kvb"}, phase="decode")
        out = absorb_out((T, H, C), dtype, lead)
        values, inputs = {"q_nope": q_nope, "out": out}, [q_nope]
    else:
        G, nid = single_op_graph(m, "mla_decode_query", {"pairs": layout[0], "output": layout[1]},
                                 {"q_nope": act(H, N), "q_pe": act(H, R)}, {"kv_b": "kvb"}, phase="decode")
        out = absorb_out((T, H, C + R), dtype, lead)
        values, inputs = {"q_nope": q_nope, "q_pe": q_pe, "out": out}, [q_nope, q_pe]
    ws, ref_ws = fp8_kv_b(G, m, gen, misaligned, q_nope)
    (launch,) = run_kernel(G, nid, dtype, values=values, weights=ws, ctx=ctx, sizes=step_sizes(step))
    assert "_wfp8__" in launch.name and "__mma_" in launch.name, launch.name
    (ref,) = reference(G, nid, inputs, ref_ws, step)
    op = "mla_q_absorb" if absorb else "mla_decode_query"
    RECS[op].check(out, ref, dtype, f"{launch.name} T={T} misaligned={misaligned}")
    RECS[op].example()
    return launch


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), absorb=st.booleans(), lens=query_lens(),
       layout=rope_layout, lead=LEAD, misaligned=st.booleans(), seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", absorb=False, lens=[1], layout=("adjacent", "interleaved"), lead=0,
         misaligned=False, seed=13)                    # V2-Lite at b = 1, every access vectorized
@example(name="lite", dtype="bf16", absorb=False, lens=[86, 85, 85], layout=("adjacent", "interleaved"), lead=0,
         misaligned=False, seed=14)                    # 8 chunks of 32 tokens
@example(name="v3", dtype="bf16", absorb=False, lens=[1] * 32, layout=("adjacent", "halves"), lead=0,
         misaligned=False, seed=15)
@example(name="x128", dtype="bf16", absorb=True, lens=[5, 4], layout=("halves", "halves"), lead=0,
         misaligned=False, seed=16)                    # W_UK rows of heads 1, 2 across a row-block edge
@example(name="tc16", dtype="fp16", absorb=False, lens=[33], layout=("adjacent", "halves"), lead=1,
         misaligned=True, seed=17)                     # byte loads, a ceil column block
@example(name="tc32", dtype="bf16", absorb=True, lens=[300], layout=("halves", "halves"), lead=2,
         misaligned=False, seed=18)
def test_mla_decode_query_fp8(name, dtype, absorb, lens, layout, lead, misaligned, seed):
    check_query(name, dtype, absorb, lens, layout, lead, misaligned, seed)


def check_prologue(name, dtype, lens, bs, layout, lead, misaligned, seed):
    """mla_decode_prologue with FP8 kv_b: the query and the cache write in one launch up to
    attention.prologue_upto tokens, two launches above; every output checked, the step's cache rows
    poisoned first."""
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    step, ctx = make_ctx(lens, [n + 40 for n in lens], block_size=bs, model=m, dtype=tdt,
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()
    T = step.num_tokens
    q_nope, q_pe = head_views(T, H, [N, R], dtype, gen, lead)
    c, k_pe = row_views(T, [C, R], dtype, gen, lead, scale=2)
    norm = shifted_view((C,), dtype, gen, lead).add_(1)
    G, nid = single_op_graph(m, "mla_decode_prologue", {"pairs": layout[0], "output": layout[1]},
                             {"q_nope": act(H, N), "q_pe": act(H, R), "c": act(C), "k_pe": act(R)},
                             {"kv_b": "kvb", "norm": "n"}, phase="decode")
    ws, ref_ws = fp8_kv_b(G, m, gen, misaligned, q_nope)
    q = absorb_out((T, H, C + R), dtype, lead)
    c_n, k_rot = empty_out((T, C), dtype), empty_out((T, R), dtype)
    cache = ctx["kv_cache"]
    cache.view(-1, C + R)[ctx["slot_mapping"]] = float("nan")
    launches = run_kernel(G, nid, dtype, values={"q_nope": q_nope, "q_pe": q_pe, "c": c, "k_pe": k_pe, "out0": q,
                                                 "out1": c_n, "out2": k_rot},
                          weights={**ws, "n": norm}, ctx=ctx, sizes=step_sizes(step), block_size=bs)
    assert "_wfp8__" in launches[0].name, launches[0].name
    ref_q, ref_cn, ref_kr, ref_cache = reference(G, nid, [q_nope, q_pe, c, k_pe], {**ref_ws, "n": norm}, step)
    rec = RECS["mla_decode_prologue"]
    where = f"{launches[0].name} T={T}"
    rec.check(q, ref_q, dtype, f"q {where}")
    rec.check(c_n, ref_cn, dtype, f"c_n {where}")
    rec.check(k_rot, ref_kr, dtype, f"k_rot {where}")
    rec.check(cache, ref_cache, dtype, f"cache {where}")
    rec.example()


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), lens=query_lens(), bs=st.sampled_from((16, 64)),
       layout=rope_layout, lead=LEAD, misaligned=st.booleans(), seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", lens=[1], bs=64, layout=("adjacent", "interleaved"), lead=0, misaligned=False,
         seed=13)
@example(name="lite", dtype="bf16", lens=[1] * 17, bs=64, layout=("adjacent", "interleaved"), lead=0,
         misaligned=False, seed=14)                    # above prologue_upto: the cache write's own kernel
@example(name="x128", dtype="fp16", lens=[3, 1, 2], bs=16, layout=("halves", "halves"), lead=1, misaligned=True,
         seed=15)
def test_mla_decode_prologue_fp8(name, dtype, lens, bs, layout, lead, misaligned, seed):
    check_prologue(name, dtype, lens, bs, layout, lead, misaligned, seed)


def check_v_up(name, dtype, T, lead, misaligned, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": act(H, C)}, {"kv_b": "kvb"}, phase="decode")
    (o_lat,) = head_views(T, H, [C], dtype, gen, lead)
    ws, ref_ws = fp8_kv_b(G, m, gen, misaligned, o_lat)
    out = absorb_out((T, H * V), dtype, lead)
    (launch,) = run_kernel(G, nid, dtype, values={"o_lat": o_lat, "out": out}, weights=ws, sizes={"T": T})
    assert "_wfp8__" in launch.name and "__mma_" in launch.name, launch.name
    (ref,) = reference(G, nid, [o_lat], ref_ws)
    RECS["mla_v_up"].check(out, ref, dtype, f"{launch.name} T={T} misaligned={misaligned}")
    RECS["mla_v_up"].example()
    return launch


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), T=st.one_of(st.integers(1, 40), token_counts()),
       lead=LEAD, misaligned=st.booleans(), seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", T=1, lead=0, misaligned=False, seed=13)
@example(name="lite", dtype="bf16", T=256, lead=0, misaligned=False, seed=14)   # 8 chunks
@example(name="lite", dtype="fp16", T=257, lead=0, misaligned=False, seed=15)   # ... and a CTA that loops
@example(name="v3", dtype="bf16", T=32, lead=0, misaligned=False, seed=16)
@example(name="tc16", dtype="bf16", T=9, lead=1, misaligned=False, seed=17)     # rows across row blocks, ceil C
@example(name="x128", dtype="fp16", T=33, lead=0, misaligned=True, seed=18)
def test_mla_v_up_fp8(name, dtype, T, lead, misaligned, seed):
    check_v_up(name, dtype, T, lead, misaligned, seed)


@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("T", TOKEN_EDGES)
@pytest.mark.parametrize("name", ["lite", "tc16", "x128"])
def test_fp8_absorb_token_edges(name, T, misaligned):
    """Every token count at a tile edge for the three kernels, kv_b aligned (4- / 8-byte loads) and not
    (byte loads)."""
    for absorb in (False, True):
        check_query(name, "bf16", absorb, split_tokens(T, 1 + T % 3), ("adjacent", "interleaved"), 0, misaligned,
                    seed=T)
    check_v_up(name, "bf16", T, 0, misaligned, seed=T)
