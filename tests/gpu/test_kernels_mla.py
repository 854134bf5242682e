"""Property tests: rope_q, mla_kv_cache_write, mla_decode_query, mla_q_absorb,
mla_decode_attention, mla_v_up, mla_prefill_attention (over the step's rows, and over a cached prefix:
keys=context) and mla_gather_context kernels against the reference ops
(float64 on the GPU): random dims (V2-Lite's and small odd ones), dtypes, strided views at
odd element offsets (`lead`: no input starts 16-byte aligned unless lead is 0), paged caches
with permuted block tables and context lengths at the page edges. The fixed regression cases
are @example rows beside each test (issue 13: fp32 decode attention whose query carve-up left
the probabilities' float4 reads misaligned)."""
import functools

import pytest
import torch
from hypothesis import example, given, strategies as st

from harness import assert_close, make_ctx, rel_error, step_sizes, tiny_model
from kernel_cases import (kernel_test, DTYPES, MODEL_NAMES, Recorder, TORCH_DTYPES, TType, act, empty_out, lower, rand,
                          reference, run_kernel, runner, single_op_graph)
from kernel_cases import model as shared_model

SETTINGS = kernel_test(25)

# MLA-only models beside the shared ones (kernel_cases.MODEL_NAMES):
#   w29:  H 3, C 23, R 6: the cache row is 29 wide (odd; 15 element pairs), so the CUDA-core
#         decode split's query block (HG * QP floats = 3 * 30) is not a multiple of 16 bytes --
#         the issue-13 crash (float4 reads of the probabilities off by 8 bytes) before the fix.
#   h20:  H 20, C 64, R 16: two head groups, the second partial (4 heads), on the CUDA-core
#         decode path (every dtype: the tensor-core split needs C % 128 == 0).
#   h20w: H 20, C 128, R 32: the same two head groups on the tensor-core decode path (bf16 / fp16),
#         with 160-wide rows: 20 16-byte chunks, the odd-pitch shared layout (576-wide rows swizzle).
LOCAL_MODELS = {
    "w29": dict(hidden=41, heads=3, kv_lora_rank=23, qk_rope_head_dim=6, qk_nope_head_dim=11, v_head_dim=13,
                intermediate=37, moe_intermediate=15),
    "h20": dict(hidden=64, heads=20, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=16,
                intermediate=48, moe_intermediate=16),
    "h20w": dict(hidden=64, heads=20, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=8, v_head_dim=16,
                 intermediate=48, moe_intermediate=16),
}
NAMES = (*MODEL_NAMES, *LOCAL_MODELS)
LEAD = st.integers(0, 3)   # elements before each view's first element in its parent buffer


@functools.lru_cache(maxsize=None)
def model(name: str):
    return tiny_model(**LOCAL_MODELS[name]) if name in LOCAL_MODELS else shared_model(name)
FAMILIES = ("rope_q", "mla_kv_cache_write", "mla_decode_query", "mla_q_absorb", "mla_decode_prologue",
            "mla_decode_attention", "mla_v_up", "mla_prefill_attention", "mla_prefill_attention.prefix",
            "mla_gather_context")
RECS = {f: Recorder(f) for f in FAMILIES}
rope_layout = st.sampled_from([("adjacent", "interleaved"), ("halves", "halves"), ("adjacent", "halves")])
BLOCK_SIZES = (16, 64)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for r in RECS.values():
        r.report()


def edge_lengths(bs: int, long: int = 1100):
    return st.one_of(st.sampled_from([1, bs - 1, bs, bs + 1, 2 * bs + 1, long]), st.integers(1, 200))


def dims(m):
    d = m.dims
    return d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"], d["qk_nope_head_dim"], d["v_head_dim"]


def head_views(T, H, widths, dtype, gen, lead: int = 0):
    """Views [T, H, w] of one [T, H, lead + sum(widths)] buffer (as split with heads makes them;
    `lead` shifts every view by that many elements)."""
    buf = rand((T, H, lead + sum(widths)), dtype, gen=gen)
    out, start = [], lead
    for w in widths:
        out.append(buf[..., start:start + w])
        start += w
    return out


def row_views(T, widths, dtype, gen, lead: int = 0, scale: float = 1.0):
    """Views [T, w] of one [T, lead + sum(widths)] buffer (as split without heads makes them)."""
    buf = rand((T, lead + sum(widths)), dtype, gen=gen, scale=scale)
    out, start = [], lead
    for w in widths:
        out.append(buf[:, start:start + w])
        start += w
    return out


def shifted(shape, dtype, gen, lead: int, scale: float = 1.0):
    """A contiguous tensor of `shape` starting `lead` elements into its storage (a weight or a
    latent that is not 16-byte aligned unless lead is 0)."""
    n = 1
    for d in shape:
        n *= d
    return rand((lead + n,), dtype, gen=gen, scale=scale)[lead:].view(shape)


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), bs=st.sampled_from(BLOCK_SIZES),
       lens=st.lists(st.integers(1, 300), min_size=1, max_size=4), layout=rope_layout, lead=LEAD,
       seed=st.integers(0, 2**31))
@example(name="odd2", dtype="bf16", bs=16, lens=[5, 1], layout=("adjacent", "interleaved"), lead=1, seed=13)
def test_rope_q(name, dtype, bs, lens, layout, lead, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(lens, [l + 7 for l in lens], block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    T = step.num_tokens
    G, nid = single_op_graph(m, "rope_q", {"pairs": layout[0], "output": layout[1]}, {"q_pe": act(H, R)}, {})
    _, q_pe = head_views(T, H, [N, R], dtype, gen, lead)
    out = empty_out((T, H, R), dtype)
    run_kernel(G, nid, dtype, values={"q_pe": q_pe, "out": out}, ctx=ctx, sizes=step_sizes(step), block_size=bs)
    (ref,) = reference(G, nid, [q_pe], step=step)
    RECS["rope_q"].check(out, ref, dtype)
    RECS["rope_q"].example()


def kv_write_case(m, T: int, dtype: str, gen, lead: int, layout):
    """mla_kv_cache_write's one-op graph and its inputs: c and k_pe ([T, C] and [T, R] views of one
    buffer, `lead` elements in) and the norm weight (weights "n")."""
    H, C, R, N, V = dims(m)
    G, nid = single_op_graph(m, "mla_kv_cache_write", {"pairs": layout[0], "output": layout[1]},
                             {"c": act(C), "k_pe": act(R)}, {"norm": "n"})
    c, k_pe = row_views(T, [C, R], dtype, gen, lead, scale=2)
    norm = shifted((C,), dtype, gen, lead).add_(1)   # in place: keeps the shifted start
    return G, nid, c, k_pe, norm


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), bs=st.sampled_from(BLOCK_SIZES),
       qlens=st.lists(st.integers(1, 200), min_size=1, max_size=4), past=st.integers(0, 130), layout=rope_layout,
       lead=LEAD, seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", bs=64, qlens=[3, 70], past=5, layout=("halves", "halves"), lead=1, seed=13)
@example(name="w29", dtype="fp32", bs=16, qlens=[17], past=2, layout=("adjacent", "interleaved"), lead=0, seed=13)
def test_mla_kv_cache_write(name, dtype, bs, qlens, past, layout, lead, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(qlens, [q + past for q in qlens], block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()
    T = step.num_tokens
    G, nid, c, k_pe, norm = kv_write_case(m, T, dtype, gen, lead, layout)
    c_n, k_rot = empty_out((T, C), dtype), empty_out((T, R), dtype)
    cache = ctx["kv_cache"]
    cache.view(-1, C + R)[ctx["slot_mapping"]] = float("nan")   # the rows this step must write
    run_kernel(G, nid, dtype, values={"c": c, "k_pe": k_pe, "out0": c_n, "out1": k_rot},
               weights={"n": norm}, ctx=ctx, sizes=step_sizes(step), block_size=bs)
    ref_cn, ref_kr, ref_cache = reference(G, nid, [c, k_pe], {"n": norm}, step)
    rec = RECS["mla_kv_cache_write"]
    rec.check(c_n, ref_cn, dtype, "c_n")
    rec.check(k_rot, ref_kr, dtype, "k_rot")
    rec.check(cache, ref_cache, dtype, "cache")
    rec.example()


# -- the absorbed projections (mla_decode_query / mla_q_absorb, mla_v_up) ---------------------
# Both run on tensor cores for bf16 / fp16 where the dims allow (codegen/families: tensor_core_params;
# lite, mid / h20 for v_up and the two models below), on CUDA cores otherwise (fp32, odd dims).
#   tc32: H 3, N 32, C 64, V 24: query in 2-warp column blocks; v_up's second m16 tile half past V.
#   tc16: H 2, N 16, C 160, V 40: query in 1-warp column blocks (C / 32 = 5); v_up in two k slices
#         of 3 and 2 chunks (the short last slice) and a second row block whose second tile is
#         wholly past V.
ABSORB_MODELS = {
    "tc32": dict(hidden=48, heads=3, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24,
                 intermediate=40, moe_intermediate=16),
    "tc16": dict(hidden=40, heads=2, kv_lora_rank=160, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=40,
                 intermediate=40, moe_intermediate=16),
}
ABSORB_NAMES = (*NAMES, *ABSORB_MODELS)
# token counts at the edges of the tensor-core tiles (8-token MMA columns, 32-token tiles,
# 8 token chunks of 32 before a CTA loops)
TOKEN_EDGES = (1, 7, 8, 9, 16, 17, 31, 32, 33, 63, 64, 65, 128, 129, 256, 257)


@functools.lru_cache(maxsize=None)
def absorb_model(name: str):
    return tiny_model(**ABSORB_MODELS[name]) if name in ABSORB_MODELS else model(name)


def token_counts():
    return st.one_of(st.sampled_from(TOKEN_EDGES), st.integers(1, 300))


@st.composite
def query_lens(draw):
    """Sequences of a decode step with one to a few query tokens each (the old strategy), or T
    tokens at a tile edge split over one to four sequences."""
    if draw(st.booleans()):
        return draw(st.lists(st.integers(1, 9), min_size=1, max_size=12))
    return split_tokens(draw(token_counts()), draw(st.integers(1, 4)))


def split_tokens(T: int, k: int) -> list[int]:
    k = min(k, T)
    return [T // k + (i < T % k) for i in range(k)]


def absorb_out(shape, dtype: str, lead: int) -> torch.Tensor:
    """The poisoned output: contiguous, starting one element into its buffer when lead is odd
    (the kernels' element-store fall-back), else where the allocation starts."""
    n = 1
    for d in shape:
        n *= d
    return empty_out((n + 1,), dtype)[lead % 2:][:n].view(shape)


def check_query(name, dtype, absorb, lens, layout, lead, seed):
    m = absorb_model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(lens, [l + 40 for l in lens], block_size=64, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    T = step.num_tokens
    q_nope, q_pe = head_views(T, H, [N, R], dtype, gen, lead)
    kv_b = shifted((H * (N + V), C), dtype, gen, lead, scale=0.1)   # lead > 0: the scalar weight path
    if absorb:
        G, nid = single_op_graph(m, "mla_q_absorb", {}, {"q_nope": act(H, N)}, {"kv_b": "kvb"}, phase="decode")
        out = absorb_out((T, H, C), dtype, lead)
        values, inputs = {"q_nope": q_nope, "out": out}, [q_nope]
    else:
        G, nid = single_op_graph(m, "mla_decode_query", {"pairs": layout[0], "output": layout[1]},
                                 {"q_nope": act(H, N), "q_pe": act(H, R)}, {"kv_b": "kvb"}, phase="decode")
        out = absorb_out((T, H, C + R), dtype, lead)
        values, inputs = {"q_nope": q_nope, "q_pe": q_pe, "out": out}, [q_nope, q_pe]
    (launch,) = run_kernel(G, nid, dtype, values=values, weights={"kvb": kv_b}, ctx=ctx, sizes=step_sizes(step))
    (ref,) = reference(G, nid, inputs, {"kvb": kv_b}, step)
    rec = RECS["mla_q_absorb" if absorb else "mla_decode_query"]
    rec.check(out, ref, dtype, f"{launch.name} T={T}")
    rec.example()
    return launch


@SETTINGS
@given(name=st.sampled_from(ABSORB_NAMES), dtype=st.sampled_from(DTYPES), absorb=st.booleans(),
       lens=query_lens(), layout=rope_layout, lead=LEAD, seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", absorb=False, lens=[1, 2], layout=("halves", "halves"), lead=3, seed=13)
@example(name="odd2", dtype="fp32", absorb=True, lens=[4], layout=("halves", "halves"), lead=1, seed=13)
@example(name="lite", dtype="bf16", absorb=False, lens=[86, 85, 85], layout=("adjacent", "interleaved"), lead=0,
         seed=13)     # tensor cores, every weight / q / output access vectorized, 8 chunks of 32 tokens
@example(name="lite", dtype="fp16", absorb=True, lens=[129], layout=("halves", "halves"), lead=0, seed=13)
@example(name="tc16", dtype="bf16", absorb=False, lens=[5, 4], layout=("adjacent", "halves"), lead=1, seed=13)
@example(name="tc32", dtype="fp16", absorb=True, lens=[300], layout=("halves", "halves"), lead=2, seed=13)
def test_mla_decode_query(name, dtype, absorb, lens, layout, lead, seed):
    check_query(name, dtype, absorb, lens, layout, lead, seed)


def check_prologue(name, dtype, lens, bs, layout, lead, seed):
    """mla_decode_prologue: the query and the cache write of one decode step in one launch while
    T <= attention.prologue_upto (tensor-core dims), their two kernels otherwise; every output checked,
    the cache rows of the step poisoned first."""
    m = absorb_model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(lens, [l + 40 for l in lens], block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()
    T = step.num_tokens
    q_nope, q_pe = head_views(T, H, [N, R], dtype, gen, lead)
    c, k_pe = row_views(T, [C, R], dtype, gen, lead, scale=2)
    kv_b = shifted((H * (N + V), C), dtype, gen, lead, scale=0.1)
    norm = shifted((C,), dtype, gen, lead).add_(1)
    G, nid = single_op_graph(m, "mla_decode_prologue", {"pairs": layout[0], "output": layout[1]},
                             {"q_nope": act(H, N), "q_pe": act(H, R), "c": act(C), "k_pe": act(R)},
                             {"kv_b": "kvb", "norm": "n"}, phase="decode")
    q = absorb_out((T, H, C + R), dtype, lead)
    c_n, k_rot = empty_out((T, C), dtype), empty_out((T, R), dtype)
    cache = ctx["kv_cache"]
    cache.view(-1, C + R)[ctx["slot_mapping"]] = float("nan")   # the rows this step must write
    launches = run_kernel(G, nid, dtype, values={"q_nope": q_nope, "q_pe": q_pe, "c": c, "k_pe": k_pe, "out0": q,
                                                 "out1": c_n, "out2": k_rot},
                          weights={"kvb": kv_b, "n": norm}, ctx=ctx, sizes=step_sizes(step), block_size=bs)
    ref_q, ref_cn, ref_kr, ref_cache = reference(G, nid, [q_nope, q_pe, c, k_pe], {"kvb": kv_b, "n": norm}, step)
    rec = RECS["mla_decode_prologue"]
    where = f"{launches[0].name} T={T}"
    rec.check(q, ref_q, dtype, f"q {where}")
    rec.check(c_n, ref_cn, dtype, f"c_n {where}")
    rec.check(k_rot, ref_kr, dtype, f"k_rot {where}")
    rec.check(cache, ref_cache, dtype, f"cache {where}")
    rec.example()
    return launches


@SETTINGS
@given(name=st.sampled_from(ABSORB_NAMES), dtype=st.sampled_from(DTYPES), lens=query_lens(),
       bs=st.sampled_from(BLOCK_SIZES), layout=rope_layout, lead=LEAD, seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", lens=[1], bs=64, layout=("adjacent", "interleaved"), lead=0, seed=13)
@example(name="lite", dtype="bf16", lens=[1] * 16, bs=64, layout=("adjacent", "interleaved"), lead=0, seed=13)
@example(name="lite", dtype="fp16", lens=[1] * 17, bs=16, layout=("halves", "halves"), lead=1, seed=13)
@example(name="tc16", dtype="bf16", lens=[5, 4], bs=16, layout=("adjacent", "halves"), lead=1, seed=13)
@example(name="tc32", dtype="fp16", lens=[3, 1, 2], bs=64, layout=("halves", "halves"), lead=2, seed=13)
@example(name="odd2", dtype="fp32", lens=[4, 1], bs=16, layout=("halves", "halves"), lead=1, seed=13)
def test_mla_decode_prologue(name, dtype, lens, bs, layout, lead, seed):
    check_prologue(name, dtype, lens, bs, layout, lead, seed)


def check_v_up(name, dtype, T, lead, seed):
    m = absorb_model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": act(H, C)}, {"kv_b": "kvb"}, phase="decode")
    (o_lat,) = head_views(T, H, [C], dtype, gen, lead)
    kv_b = shifted((H * (N + V), C), dtype, gen, lead, scale=0.1)
    out = absorb_out((T, H * V), dtype, lead)
    (launch,) = run_kernel(G, nid, dtype, values={"o_lat": o_lat, "out": out}, weights={"kvb": kv_b}, sizes={"T": T})
    (ref,) = reference(G, nid, [o_lat], {"kvb": kv_b})
    RECS["mla_v_up"].check(out, ref, dtype, f"{launch.name} T={T}")
    RECS["mla_v_up"].example()
    return launch


@SETTINGS
@given(name=st.sampled_from(ABSORB_NAMES), dtype=st.sampled_from(DTYPES),
       T=st.one_of(st.integers(1, 40), token_counts()), lead=LEAD, seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", T=9, lead=1, seed=13)
@example(name="odd2", dtype="fp16", T=3, lead=0, seed=13)
@example(name="lite", dtype="bf16", T=256, lead=0, seed=13)   # tensor cores, vectorized, 8 chunks
@example(name="lite", dtype="fp16", T=257, lead=0, seed=13)   # ... and a CTA that loops
@example(name="tc16", dtype="bf16", T=65, lead=1, seed=13)
@example(name="h20", dtype="fp16", T=33, lead=0, seed=13)
def test_mla_v_up(name, dtype, T, lead, seed):
    check_v_up(name, dtype, T, lead, seed)


@pytest.mark.parametrize("lead", [0, 1])
@pytest.mark.parametrize("T", TOKEN_EDGES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["lite", "tc32", "tc16"])
def test_absorb_token_edges(name, dtype, T, lead):
    """Every token count at a tile edge, for the three kernels, aligned (lead 0: every vector
    path) and not (lead 1: every scalar fall-back); bf16 / fp16 take the tensor-core kernels."""
    launches = [check_query(name, dtype, absorb, split_tokens(T, 1 + T % 3), ("adjacent", "interleaved"), lead,
                            seed=T) for absorb in (False, True)]
    launches.append(check_v_up(name, dtype, T, lead, seed=T))
    assert all(("__mma_" in la.name) == (dtype != "fp32") for la in launches), [la.name for la in launches]


@st.composite
def decode_batch(draw):
    bs = draw(st.sampled_from(BLOCK_SIZES))
    ctx_lens = draw(st.lists(edge_lengths(bs, long=draw(st.sampled_from([1100, 2500]))), min_size=1, max_size=6))
    multi = draw(st.booleans())
    qlens = [draw(st.integers(1, min(c, 3))) if multi else 1 for c in ctx_lens]
    return bs, qlens, ctx_lens


def decode_graph(m):
    H, C, R, N, V = dims(m)
    return single_op_graph(m, "mla_decode_attention", {},
                           {"q_lat": act(H, C), "q_rot": act(H, R), "kv": TType(("cache",), "state")}, {},
                           phase="decode")


def live_launch(launches, sizes):
    """The one decode attention launch whose grid is not empty at these sizes (its params["cs"]
    is the split count S)."""
    from codegen import sizes as size_exprs
    full = runner().step_sizes(sizes, {})
    live = [la for la in launches if 0 not in tuple(size_exprs.evaluate(g, full) for g in la.grid)]
    assert len(live) == 1, [la.name for la in live]
    return live[0]


def run_decode(G, nid, dtype: str, *, values, ctx, sizes, block_size: int = 64, launches=None):
    """Lower decode attention (or take `launches`) and run the one launch these sizes select (one
    per split count; the returned live launch's params["cs"] is S, which the tests report)."""
    launches = launches or lower(G, nid, dtype, block_size)
    live = live_launch(launches, sizes)
    runner().run(live, values=values, ctx=ctx, sizes=sizes)
    torch.cuda.synchronize()
    return launches, live


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), batch=decode_batch(), lead=LEAD,
       seed=st.integers(0, 2**31))
@example(name="w29", dtype="fp32", batch=(16, [1, 1], [1, 300]), lead=0, seed=13)    # issue 13
@example(name="w29", dtype="bf16", batch=(64, [1, 2], [65, 1100]), lead=1, seed=13)
@example(name="odd2", dtype="fp32", batch=(16, [1], [33]), lead=1, seed=13)
@example(name="h20", dtype="bf16", batch=(16, [1, 1, 1], [1, 17, 2500]), lead=0, seed=13)
@example(name="h20", dtype="fp32", batch=(64, [2], [129]), lead=3, seed=13)
@example(name="h20w", dtype="bf16", batch=(16, [1, 1, 1], [1, 17, 2500]), lead=0, seed=13)   # mma, two groups
@example(name="h20w", dtype="fp16", batch=(64, [3, 1], [64, 65]), lead=1, seed=13)           # mma, scalar queries
@example(name="lite", dtype="bf16", batch=(64, [1, 1, 1, 1], [1, 63, 64, 513]), lead=0, seed=13)   # 16-byte queries
def test_mla_decode_attention(name, dtype, batch, lead, seed):
    bs, qlens, ctx_lens = batch
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(qlens, ctx_lens, block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()   # the reference reads the same (rounded) rows
    T = step.num_tokens
    G, nid = decode_graph(m)
    q_lat, q_rot = head_views(T, H, [C, R], dtype, gen, lead)
    out = empty_out((T, H, C), dtype)
    sizes = step_sizes(step, W=int(ctx["block_tables"].shape[1]))
    run_decode(G, nid, dtype, values={"q_lat": q_lat, "q_rot": q_rot, "out": out}, ctx=ctx, sizes=sizes,
               block_size=bs)
    (ref,) = reference(G, nid, [q_lat, q_rot, None], step=step)
    RECS["mla_decode_attention"].check(out, ref, dtype)
    RECS["mla_decode_attention"].example()


@pytest.mark.parametrize("name,dtype,ctx_len", [("odd2", "fp32", 33000), ("lite", "bf16", 17000), ("h20", "fp16", 300),
                                                ("h20w", "bf16", 5000)])
@pytest.mark.parametrize("sms", [1, 7, 40, 4096])
def test_mla_decode_attention_split_count(name, dtype, ctx_len, sms):
    """The splits follow the SM count the runner is given (SMS): clusters of S CTAs (a power of two,
    at most MAX_S), G of them an item (G > 1 only on tensor cores: the level-2 merge). With 4096
    "SMs" the long contexts reach the largest cluster and, on tensor cores, several of them an item
    (more CTAs than the GPU holds: later waves take the last tickets); with one SM it is one CTA;
    exactly one launch runs, and the result is the same whatever S and G."""
    from codegen.families import mla_decode_attention as fam
    m = model(name)
    H, C, R, N, V = dims(m)
    step, ctx = make_ctx([1, 1], [ctx_len, 5], block_size=64, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=sms)
    step.kv_cache[0] = ctx["kv_cache"].double()
    T = step.num_tokens
    G, nid = decode_graph(m)
    q_lat, q_rot = head_views(T, H, [C, R], dtype, torch.Generator().manual_seed(sms))
    out = empty_out((T, H, C), dtype)
    sizes = step_sizes(step, W=int(ctx["block_tables"].shape[1]), SMS=sms)
    _, live = run_decode(G, nid, dtype, values={"q_lat": q_lat, "q_rot": q_rot, "out": out}, ctx=ctx, sizes=sizes)
    S, Gs = live.params["cs"], clusters_per_item(live, sizes, T, H)
    assert 1 <= S <= fam.MAX_S and S & (S - 1) == 0, S
    assert 1 <= Gs <= fam.GMAX and (Gs == 1 or live.params["mma"]), Gs
    if sms == 4096 and ctx_len > 10000:
        assert S == fam.MAX_S, S
        assert Gs > 1 or not live.params["mma"], Gs
    if sms == 1:
        assert S * Gs == 1, (S, Gs)
    (ref,) = reference(G, nid, [q_lat, q_rot, None], step=step)
    RECS["mla_decode_attention"].check(out, ref, dtype, f"S={S} G={Gs}")


def clusters_per_item(live, sizes, T, H) -> int:
    """G, the clusters of the live launch per (token, head group): its grid over T * NG * S."""
    from codegen import sizes as size_exprs
    full = runner().step_sizes(sizes, {})
    NG = -(-H // live.params["HG"])
    return size_exprs.evaluate(live.grid[0], full) // (T * NG * live.params["cs"])


PERF_VARIANTS = ("w8s2c8", "w4s3c8", "w8s3c4")   # bench/perf_decode.py's candidates beside the default


def _variant(tag: str):
    import re
    from codegen.families import mla_decode_attention as fam
    w, st_, c = map(int, re.fullmatch(r"w(\d+)s(\d+)c(\d+)", tag).groups())
    return fam.Variant(warps=w, stages=st_, cluster=c)


@pytest.mark.parametrize("variant", PERF_VARIANTS)
@pytest.mark.parametrize("name,dtype", [("lite", "bf16")])
def test_mla_decode_attention_variants(variant, name, dtype):
    """Every tile / ring / cluster variant the timing script compares computes the same attention
    (long and short contexts, page edges, several query tokens of one sequence; its largest split
    count and no split), so the fastest can become the default on its timing alone. Two kernels a
    variant (NVRTC takes ~10 s for each on the device)."""
    from codegen.families import mla_decode_attention as fam
    from codegen.kernel import Options
    v = _variant(variant)
    m = model(name)
    H, C, R, N, V = dims(m)
    if not fam.use_mma(C, R, dtype, v):
        pytest.skip(f"{variant}: {name} is on the CUDA-core path")
    step, ctx = make_ctx([1, 1, 3, 1, 1], [1, 63, 65, 700, 3000], block_size=64, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=11)
    step.kv_cache[0] = ctx["kv_cache"].double()
    T = step.num_tokens
    G, nid = decode_graph(m)
    q_lat, q_rot = head_views(T, H, [C, R], dtype, torch.Generator().manual_seed(11))
    (ref,) = reference(G, nid, [q_lat, q_rot, None], step=step)
    launches = fam.lower(nid, G, Options(dtype=dtype, block_size=64), variant=v)
    for sms in (4096, 1):
        out = empty_out((T, H, C), dtype)
        sizes = step_sizes(step, W=int(ctx["block_tables"].shape[1]), SMS=sms)
        _, live = run_decode(G, nid, dtype, values={"q_lat": q_lat, "q_rot": q_rot, "out": out}, ctx=ctx,
                             sizes=sizes, launches=launches)
        RECS["mla_decode_attention"].check(
            out, ref, dtype, f"{variant} SMS={sms} S={live.params['cs']} G={clusters_per_item(live, sizes, T, H)}")


def test_mla_decode_attention_graph_replay():
    """The launch keeps no state between runs (the level-2 tickets reset themselves; the records are
    summed in cluster order whichever CTA arrives last): two eager runs and two replays of a captured
    CUDA graph give the same bits, for every launch form: clusters of 8, two an item (SMS 132);
    clusters of 2, six an item (SMS 40); one CTA an item (SMS 1)."""
    m = model("lite")
    H, C, R, N, V = dims(m)
    step, ctx = make_ctx([1, 1, 1], [700, 65, 1300], block_size=64, model=m, dtype=torch.bfloat16, seed=5)
    T = step.num_tokens
    G, nid = decode_graph(m)
    q_lat, q_rot = head_views(T, H, [C, R], "bf16", torch.Generator().manual_seed(5))
    launches = lower(G, nid, "bf16")
    for sms, want in ((132, (8, 2)), (40, (2, 6)), (1, (1, 1))):
        sizes = step_sizes(step, W=int(ctx["block_tables"].shape[1]), SMS=sms)
        outs = [empty_out((T, H, C), "bf16") for _ in range(3)]

        live = live_launch(launches, sizes)
        assert (live.params["cs"], clusters_per_item(live, sizes, T, H)) == want, sms

        def step_once(o):
            runner().run(live, values={"q_lat": q_lat, "q_rot": q_rot, "out": o}, ctx=ctx, sizes=sizes)

        step_once(outs[0])
        step_once(outs[1])
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                step_once(outs[2])
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(2):
            outs[2].fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[2], outs[0]), f"graph replay differs (SMS={sms})"
        assert torch.equal(outs[1], outs[0]), f"second eager run differs (SMS={sms})"
        assert not torch.isnan(outs[0].float()).any()


@kernel_test(6)
@given(ctx_lens=st.lists(st.one_of(st.sampled_from([1, 63, 64, 65, 512, 4096]), st.integers(1, 2200)),
                         min_size=1, max_size=4),
       qlen=st.integers(1, 3), seed=st.integers(0, 2**31))
@example(ctx_lens=[512], qlen=1, seed=11)        # the bench's b=1 shape: one cluster of 8 one-tile splits
@example(ctx_lens=[4096], qlen=1, seed=12)       # eight clusters of 8 (level-2 merge)
@example(ctx_lens=[1, 65, 700, 1300], qlen=1, seed=13)
@example(ctx_lens=[512, 65], qlen=3, seed=14)    # tokens after their sequence's first (fresh_from's load)
def test_mla_decode_attention_reads_this_steps_rows_after_its_wait(ctx_lens, qlen, seed):
    """Programmatic dependent launch: the kernel right before the attention writes this step's
    cache rows (mla_kv_cache_write; both launches PDL, replayed from a captured graph so that the
    attention's CTAs start while the writer runs) into rows poisoned with NaN before every replay:
    an attention that read one of them before its pdl_wait() returns NaN.  mla_decode.cuh's
    tensor-core split reads the rows of earlier steps before its wait and only this step's after it (DecodeSplit::fresh_from): this is the test of that line.
    Up to qlen tokens a sequence (each at most its context): a token after its sequence's first
    finds the step's first row from the first token's position."""
    import dataclasses
    m = model("lite")
    H, C, R, N, V = dims(m)
    dtype = "bf16"
    step, ctx = make_ctx([min(qlen, c) for c in ctx_lens], ctx_lens, block_size=64, model=m, dtype=torch.bfloat16,
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    T = step.num_tokens
    gen = torch.Generator().manual_seed(seed)
    Gw, nw, c, k_pe, norm = kv_write_case(m, T, dtype, gen, 0, ("halves", "halves"))
    Ga, na = decode_graph(m)
    q_lat, q_rot = head_views(T, H, [C, R], dtype, gen, 0)
    out = empty_out((T, H, C), dtype)
    values = {"c": c, "k_pe": k_pe, "out0": empty_out((T, C), dtype), "out1": empty_out((T, R), dtype),
              "q_lat": q_lat, "q_rot": q_rot, "out": out}
    sizes = step_sizes(step, W=int(ctx["block_tables"].shape[1]))
    write = [dataclasses.replace(la, pdl=True) for la in lower(Gw, nw, dtype)]
    attend = dataclasses.replace(live_launch(lower(Ga, na, dtype), sizes), pdl=True)
    fresh = ctx["kv_cache"].view(-1, C + R)[ctx["slot_mapping"]].clone()

    def chain():
        runner().run_all(write, values=values, weights={"n": norm}, ctx=ctx, sizes=sizes)
        runner().run(attend, values=values, ctx=ctx, sizes=sizes)

    chain()                                  # loads the modules outside the capture
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            chain()
    torch.cuda.current_stream().wait_stream(stream)
    first = None
    for _ in range(4):
        ctx["kv_cache"].view(-1, C + R)[ctx["slot_mapping"]] = float("nan")   # the rows this step writes
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert not torch.isnan(out.float()).any(), "the attention read a row of this step before it was written"
        first = out.clone() if first is None else first
        assert torch.equal(out, first), "a replay differs from the first"
    written = ctx["kv_cache"].view(-1, C + R)[ctx["slot_mapping"]]
    assert not torch.equal(written, fresh)   # the writer did write them (the reference below reads them)
    step.kv_cache[0] = ctx["kv_cache"].double()
    (ref,) = reference(Ga, na, [q_lat, q_rot, None], step=step)
    RECS["mla_decode_attention"].check(out, ref, dtype, "after a PDL writer")
    RECS["mla_decode_attention"].example()


# FlashMLA's published decode test matrix (tests/test_flash_mla.py there: batch 128, contexts 4096 /
# 8192 / 16384, fixed and variable lengths, 16 to 128 query heads, 576-wide rows of which 512 are
# values), through our paged cache with permuted block tables, bf16, against float64 computed on
# the GPU sequence by sequence. sms = 4096 forces clusters of 8, two an item at 16 heads (both merge
# levels at full scale, in several waves), or of 2 (64 / 128 heads); 0 keeps the device's SM count
# (S = 1 at batch 128).
FLASH_BATCH, FLASH_PAGE = 128, 64


def _flash_case(H: int, ctx_len: int, varlen: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    if varlen:   # FlashMLA draws normal(ctx, ctx / 2); here clipped to [1, ctx], with both ends present
        lens = torch.normal(float(ctx_len), ctx_len / 2, (FLASH_BATCH,), generator=g).clamp(1, ctx_len).long()
        lens[0], lens[-1] = 1, ctx_len
    else:
        lens = torch.full((FLASH_BATCH,), ctx_len, dtype=torch.long)
    pages = (lens + FLASH_PAGE - 1) // FLASH_PAGE
    num_blocks = int(pages.sum()) + 3
    perm = torch.randperm(num_blocks, generator=g)
    W = int(pages.max())
    tables = torch.zeros(FLASH_BATCH, W, dtype=torch.int32)
    starts = torch.cumsum(pages, 0) - pages
    for b in range(FLASH_BATCH):
        tables[b, :pages[b]] = perm[starts[b]:starts[b] + pages[b]].to(torch.int32)
    gpu = torch.Generator(device="cuda").manual_seed(seed)
    cache = torch.randn(num_blocks, FLASH_PAGE, 576, generator=gpu, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(FLASH_BATCH, H, 576, generator=gpu, device="cuda", dtype=torch.bfloat16)
    ctx = {"kv_cache": cache, "block_tables": tables.cuda(), "context_lens": lens.to("cuda", torch.int32),
           "query_start": torch.arange(FLASH_BATCH + 1, dtype=torch.int32, device="cuda"),
           "positions": (lens - 1).cuda(), "slot_mapping": torch.zeros(FLASH_BATCH, dtype=torch.int64, device="cuda")}
    return lens, tables, cache, q, ctx, W


@kernel_test(3)
@given(H=st.sampled_from([16, 32, 64, 128]), ctx_len=st.sampled_from([4096, 8192, 16384]), varlen=st.booleans(),
       sms=st.sampled_from([0, 4096]), seed=st.integers(0, 2**31))
@example(H=128, ctx_len=16384, varlen=True, sms=0, seed=1)
@example(H=16, ctx_len=4096, varlen=False, sms=4096, seed=2)
@example(H=64, ctx_len=8192, varlen=True, sms=4096, seed=3)
def test_mla_decode_attention_flashmla_matrix(H, ctx_len, varlen, sms, seed):
    m = tiny_model(hidden=64, heads=H, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   intermediate=48, moe_intermediate=16)
    C = 512
    lens, tables, cache, q, ctx, W = _flash_case(H, ctx_len, varlen, seed)
    G, nid = decode_graph(m)
    out = empty_out((FLASH_BATCH, H, C), "bf16")
    sizes = {"T": FLASH_BATCH, "B": FLASH_BATCH, "NP": FLASH_BATCH, "MAXQ": 1, "MAXCTX": int(lens.max()), "W": W}
    if sms:
        sizes["SMS"] = sms
    _, live = run_decode(G, nid, "bf16", values={"q_lat": q[..., :C], "q_rot": q[..., C:], "out": out}, ctx=ctx,
                         sizes=sizes, block_size=FLASH_PAGE)
    S = live.params["cs"]
    Gs = clusters_per_item(live, runner().step_sizes(sizes, {}), FLASH_BATCH, H)
    scale = m.softmax_scale
    worst = 0.0
    for b in range(FLASH_BATCH):
        n = int(lens[b])
        rows = cache[tables[b, :(n + FLASH_PAGE - 1) // FLASH_PAGE].long().cuda()].reshape(-1, 576)[:n].double()
        p = torch.softmax((q[b].double() @ rows.T) * scale, dim=-1)
        ref = p @ rows[:, :C]
        err = rel_error(out[b], ref)
        worst = max(worst, err)
        assert err <= 1e-2, f"sequence {b} (length {n}, H {H}, S {S}, G {Gs}): norm-wise relative error {err:.3g} > 1e-2"
    print(f"flashmla matrix H={H} ctx={ctx_len} varlen={varlen} S={S} G={Gs}: worst per-sequence error {worst:.3g}")


@st.composite
def prefill_batch(draw):
    return draw(st.lists(st.one_of(st.sampled_from([1, 31, 32, 33, 63, 64, 65, 1030]), st.integers(1, 150)),
                         min_size=1, max_size=4))


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), qlens=prefill_batch(), lead=LEAD,
       seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", qlens=[65, 3], lead=1, seed=13)     # the tensor-core gather path
@example(name="odd2", dtype="fp16", qlens=[33], lead=0, seed=13)
def test_mla_prefill_attention(name, dtype, qlens, lead, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(qlens, block_size=64, model=m, dtype=TORCH_DTYPES[dtype], ref_dtype=torch.float64,
                         ref_device="cuda", seed=seed)
    T = step.num_tokens
    G, nid = single_op_graph(m, "mla_prefill_attention", {},
                             {"q_nope": act(H, N), "q_rot": act(H, R), "kv": act(H * (N + V)), "k_rot": act(R)}, {})
    q_nope, _ = head_views(T, H, [N, R], dtype, gen, lead)
    q_rot = shifted((T, H, R), dtype, gen, lead)
    (kv,) = row_views(T, [H * (N + V)], dtype, gen, lead)
    _, k_rot = row_views(T, [C, R], dtype, gen, lead)
    out = empty_out((T, H * V), dtype)
    run_kernel(G, nid, dtype, values={"q_nope": q_nope, "q_rot": q_rot, "kv": kv, "k_rot": k_rot, "out": out},
               ctx=ctx, sizes=step_sizes(step))
    (ref,) = reference(G, nid, [q_nope, q_rot, kv, k_rot], step=step)
    RECS["mla_prefill_attention"].check(out, ref, dtype)
    RECS["mla_prefill_attention"].example()


# -- chunked prefill: the context gather and the attention over a cached prefix ---------------
# A chunk of query_lens[b] tokens whose sequence held prefix[b] rows before the step: positions
# prefix .. prefix + q - 1; its keys are the sequence's context_lens[b] = prefix + q rows, packed at
# key_start[b] (mla_gather_context's rows, decompressed).  Prefixes at 0 and across page edges.

def prefix_lengths(bs: int = 64):
    return st.one_of(st.sampled_from([0, 1, bs - 1, bs, bs + 1, 2 * bs + 3, 700]), st.integers(0, 200))


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), bs=st.sampled_from(BLOCK_SIZES),
       qlens=st.lists(st.integers(1, 150), min_size=1, max_size=4), prefixes=st.lists(prefix_lengths(), min_size=4,
                                                                                       max_size=4),
       seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", bs=64, qlens=[1, 65], prefixes=[64, 0, 0, 0], seed=13)
@example(name="odd2", dtype="fp32", bs=16, qlens=[3], prefixes=[17, 0, 0, 0], seed=13)
def test_mla_gather_context(name, dtype, bs, qlens, prefixes, seed):
    m = model(name)
    ctxs = [q + p for q, p in zip(qlens, prefixes)]
    step, ctx = make_ctx(qlens, ctxs, block_size=bs, model=m, dtype=TORCH_DTYPES[dtype], ref_dtype=torch.float64,
                         ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()
    G, nid = single_op_graph(m, "mla_gather_context", {}, {"state": TType(("cache",), "state")}, {})
    out = empty_out((sum(ctxs), m.cache_width), dtype)
    run_kernel(G, nid, dtype, values={"out": out}, ctx=ctx, sizes=step_sizes(step), block_size=bs)
    (ref,) = reference(G, nid, [ctx["kv_cache"]], step=step)
    assert torch.equal(out.double(), ref.double()), "a gathered row differs from its cache row"   # a copy: exact
    RECS["mla_gather_context"].example()


@SETTINGS
@given(name=st.sampled_from(NAMES), dtype=st.sampled_from(DTYPES), qlens=prefill_batch(),
       prefixes=st.lists(prefix_lengths(), min_size=4, max_size=4), lead=LEAD, seed=st.integers(0, 2**31))
@example(name="lite", dtype="bf16", qlens=[1, 65, 3], prefixes=[4095, 64, 0, 0], lead=0, seed=13)   # a decode token
@example(name="lite", dtype="bf16", qlens=[64, 33], prefixes=[63, 1, 0, 0], lead=1, seed=13)        # gather path
@example(name="odd2", dtype="fp32", qlens=[33], prefixes=[65, 0, 0, 0], lead=0, seed=13)
def test_mla_prefill_attention_over_a_cached_prefix(name, dtype, qlens, prefixes, lead, seed):
    """keys=context: each chunk's queries attend causally to the prefix's rows and their own (its
    queries' positions shifted by the prefix), against the reference op in float64."""
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    ctxs = [q + p for q, p in zip(qlens, prefixes)]
    step, ctx = make_ctx(qlens, ctxs, block_size=64, model=m, dtype=TORCH_DTYPES[dtype], ref_dtype=torch.float64,
                         ref_device="cuda", seed=seed)
    T, TK = step.num_tokens, sum(ctxs)
    G, nid = single_op_graph(m, "mla_prefill_attention", {"keys": "context"},
                             {"q_nope": act(H, N), "q_rot": act(H, R), "kv": act(H * (N + V)), "k_rot": act(R)}, {})
    q_nope, _ = head_views(T, H, [N, R], dtype, gen, lead)
    q_rot = shifted((T, H, R), dtype, gen, lead)
    (kv,) = row_views(TK, [H * (N + V)], dtype, gen, lead)
    _, k_rot = row_views(TK, [C, R], dtype, gen, lead)
    out = empty_out((T, H * V), dtype)
    run_kernel(G, nid, dtype, values={"q_nope": q_nope, "q_rot": q_rot, "kv": kv, "k_rot": k_rot, "out": out},
               ctx=ctx, sizes=step_sizes(step))
    (ref,) = reference(G, nid, [q_nope, q_rot, kv, k_rot], step=step)
    RECS["mla_prefill_attention.prefix"].check(out, ref, dtype)
    RECS["mla_prefill_attention.prefix"].example()


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_over_a_prefix_equals_the_unchunked_rows(dtype):
    """The chunk's rows of one whole-prompt attention (keys=step over all rows) equal the chunk's
    attention over the cached prefix (keys=context), kernel against kernel: the causal shift is
    the prefix, not a prompt that starts at the chunk."""
    m = model("lite")
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(7)
    L, P = 200, 130
    q_nope, q_rot = head_views(L, H, [N, R], dtype, gen)
    (kv,) = row_views(L, [H * (N + V)], dtype, gen)
    _, k_rot = row_views(L, [C, R], dtype, gen)
    qkinds = {"q_nope": act(H, N), "q_rot": act(H, R), "kv": act(H * (N + V)), "k_rot": act(R)}
    step, ctx = make_ctx([L], block_size=64, model=m, dtype=TORCH_DTYPES[dtype], seed=7)
    G, nid = single_op_graph(m, "mla_prefill_attention", {}, qkinds, {})
    whole = empty_out((L, H * V), dtype)
    run_kernel(G, nid, dtype, values={"q_nope": q_nope, "q_rot": q_rot, "kv": kv, "k_rot": k_rot, "out": whole},
               ctx=ctx, sizes=step_sizes(step))
    cstep, cctx = make_ctx([L - P], [L], block_size=64, model=m, dtype=TORCH_DTYPES[dtype], seed=7)
    Gc, nc = single_op_graph(m, "mla_prefill_attention", {"keys": "context"}, qkinds, {})
    chunk = empty_out((L - P, H * V), dtype)
    run_kernel(Gc, nc, dtype, values={"q_nope": q_nope[P:], "q_rot": q_rot[P:], "kv": kv, "k_rot": k_rot,
                                      "out": chunk}, ctx=cctx, sizes=step_sizes(cstep))
    assert_close(chunk, whole[P:], dtype, "the chunk's rows against the whole prompt's")
