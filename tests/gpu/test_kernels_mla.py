"""Property tests: rope_q, mla_kv_cache_write, mla_decode_query, mla_q_absorb,
mla_decode_attention, mla_v_up, mla_prefill_attention kernels against the reference ops
(float64 on the GPU): random dims (V2-Lite's and small odd ones), dtypes, strided views,
paged caches with permuted block tables and context lengths at the page edges."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from harness import make_ctx, step_sizes
from kernel_cases import (kernel_test, DTYPES, MODEL_NAMES, Recorder, TORCH_DTYPES, TType, act, empty_out, model, rand,
                          reference, run_kernel, single_op_graph)

SETTINGS = kernel_test(25)
FAMILIES = ("rope_q", "mla_kv_cache_write", "mla_decode_query", "mla_q_absorb", "mla_decode_attention",
            "mla_v_up", "mla_prefill_attention")
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


def head_views(T, H, widths, dtype, gen):
    """Views [T, H, w] of one [T, H, sum(widths)] buffer (as split with heads makes them)."""
    buf = rand((T, H, sum(widths)), dtype, gen=gen)
    out, start = [], 0
    for w in widths:
        out.append(buf[..., start:start + w])
        start += w
    return out


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), bs=st.sampled_from(BLOCK_SIZES),
       lens=st.lists(st.integers(1, 300), min_size=1, max_size=4), layout=rope_layout, seed=st.integers(0, 2**31))
def test_rope_q(name, dtype, bs, lens, layout, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(lens, [l + 7 for l in lens], block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    T = step.num_tokens
    G, nid = single_op_graph(m, "rope_q", {"pairs": layout[0], "output": layout[1]}, {"q_pe": act(H, R)}, {})
    _, q_pe = head_views(T, H, [N, R], dtype, gen)
    out = empty_out((T, H, R), dtype)
    run_kernel(G, nid, dtype, values={"q_pe": q_pe, "out": out}, ctx=ctx, sizes=step_sizes(step), block_size=bs)
    (ref,) = reference(G, nid, [q_pe], step=step)
    RECS["rope_q"].check(out, ref, dtype)
    RECS["rope_q"].example()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), bs=st.sampled_from(BLOCK_SIZES),
       qlens=st.lists(st.integers(1, 200), min_size=1, max_size=4), past=st.integers(0, 130), layout=rope_layout,
       seed=st.integers(0, 2**31))
def test_mla_kv_cache_write(name, dtype, bs, qlens, past, layout, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(qlens, [q + past for q in qlens], block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()
    T = step.num_tokens
    G, nid = single_op_graph(m, "mla_kv_cache_write", {"pairs": layout[0], "output": layout[1]},
                             {"c": act(C), "k_pe": act(R)}, {"norm": "n"})
    ckv = rand((T, C + R), dtype, gen=gen, scale=2)
    c, k_pe = ckv[:, :C], ckv[:, C:]
    norm = rand((C,), dtype, gen=gen) + 1
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


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), absorb=st.booleans(),
       lens=st.lists(st.integers(1, 9), min_size=1, max_size=12), layout=rope_layout, seed=st.integers(0, 2**31))
def test_mla_decode_query(name, dtype, absorb, lens, layout, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(lens, [l + 40 for l in lens], block_size=64, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    T = step.num_tokens
    q_nope, q_pe = head_views(T, H, [N, R], dtype, gen)
    kv_b = rand((H * (N + V), C), dtype, gen=gen, scale=0.1)
    if absorb:
        G, nid = single_op_graph(m, "mla_q_absorb", {}, {"q_nope": act(H, N)}, {"kv_b": "kvb"}, phase="decode")
        out = empty_out((T, H, C), dtype)
        values, inputs = {"q_nope": q_nope, "out": out}, [q_nope]
    else:
        G, nid = single_op_graph(m, "mla_decode_query", {"pairs": layout[0], "output": layout[1]},
                                 {"q_nope": act(H, N), "q_pe": act(H, R)}, {"kv_b": "kvb"}, phase="decode")
        out = empty_out((T, H, C + R), dtype)
        values, inputs = {"q_nope": q_nope, "q_pe": q_pe, "out": out}, [q_nope, q_pe]
    run_kernel(G, nid, dtype, values=values, weights={"kvb": kv_b}, ctx=ctx, sizes=step_sizes(step))
    (ref,) = reference(G, nid, inputs, {"kvb": kv_b}, step)
    rec = RECS["mla_q_absorb" if absorb else "mla_decode_query"]
    rec.check(out, ref, dtype)
    rec.example()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), T=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_mla_v_up(name, dtype, T, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "mla_v_up", {}, {"o_lat": act(H, C)}, {"kv_b": "kvb"}, phase="decode")
    o_lat = rand((T, H, C), dtype, gen=gen)
    kv_b = rand((H * (N + V), C), dtype, gen=gen, scale=0.1)
    out = empty_out((T, H * V), dtype)
    run_kernel(G, nid, dtype, values={"o_lat": o_lat, "out": out}, weights={"kvb": kv_b}, sizes={"T": T})
    (ref,) = reference(G, nid, [o_lat], {"kvb": kv_b})
    RECS["mla_v_up"].check(out, ref, dtype)
    RECS["mla_v_up"].example()


@st.composite
def decode_batch(draw):
    bs = draw(st.sampled_from(BLOCK_SIZES))
    ctx_lens = draw(st.lists(edge_lengths(bs, long=draw(st.sampled_from([1100, 2500]))), min_size=1, max_size=6))
    multi = draw(st.booleans())
    qlens = [draw(st.integers(1, min(c, 3))) if multi else 1 for c in ctx_lens]
    return bs, qlens, ctx_lens


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), batch=decode_batch(), seed=st.integers(0, 2**31))
def test_mla_decode_attention(name, dtype, batch, seed):
    bs, qlens, ctx_lens = batch
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(qlens, ctx_lens, block_size=bs, model=m, dtype=TORCH_DTYPES[dtype],
                         ref_dtype=torch.float64, ref_device="cuda", seed=seed)
    step.kv_cache[0] = ctx["kv_cache"].double()   # the reference reads the same (rounded) rows
    T = step.num_tokens
    G, nid = single_op_graph(m, "mla_decode_attention", {},
                             {"q_lat": act(H, C), "q_rot": act(H, R), "kv": TType(("cache",), "state")}, {},
                             phase="decode")
    q_lat, q_rot = head_views(T, H, [C, R], dtype, gen)
    out = empty_out((T, H, C), dtype)
    sizes = step_sizes(step, W=int(ctx["block_tables"].shape[1]))
    run_kernel(G, nid, dtype, values={"q_lat": q_lat, "q_rot": q_rot, "out": out}, ctx=ctx, sizes=sizes,
               block_size=bs)
    (ref,) = reference(G, nid, [q_lat, q_rot, None], step=step)
    RECS["mla_decode_attention"].check(out, ref, dtype)
    RECS["mla_decode_attention"].example()


@st.composite
def prefill_batch(draw):
    return draw(st.lists(st.one_of(st.sampled_from([1, 31, 32, 33, 63, 64, 65, 1030]), st.integers(1, 150)),
                         min_size=1, max_size=4))


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), qlens=prefill_batch(), seed=st.integers(0, 2**31))
def test_mla_prefill_attention(name, dtype, qlens, seed):
    m = model(name)
    H, C, R, N, V = dims(m)
    gen = torch.Generator().manual_seed(seed)
    step, ctx = make_ctx(qlens, block_size=64, model=m, dtype=TORCH_DTYPES[dtype], ref_dtype=torch.float64,
                         ref_device="cuda", seed=seed)
    T = step.num_tokens
    G, nid = single_op_graph(m, "mla_prefill_attention", {},
                             {"q_nope": act(H, N), "q_rot": act(H, R), "kv": act(H * (N + V)), "k_rot": act(R)}, {})
    q_nope, _ = head_views(T, H, [N, R], dtype, gen)
    q_rot = rand((T, H, R), dtype, gen=gen)
    kv = rand((T, H * (N + V)), dtype, gen=gen)
    k_rot = rand((T, C + R), dtype, gen=gen)[:, C:]
    out = empty_out((T, H * V), dtype)
    run_kernel(G, nid, dtype, values={"q_nope": q_nope, "q_rot": q_rot, "kv": kv, "k_rot": k_rot, "out": out},
               ctx=ctx, sizes=step_sizes(step))
    (ref,) = reference(G, nid, [q_nope, q_rot, kv, k_rot], step=step)
    RECS["mla_prefill_attention"].check(out, ref, dtype)
    RECS["mla_prefill_attention"].example()
