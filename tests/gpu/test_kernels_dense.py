"""Property tests: embedding, rms_norm, fused_add_rms_norm, add, silu_and_mul kernels
against the ops' reference semantics (float64), on random shapes, dtypes and strided views.

Models come from kernel_cases.MODEL_NAMES, among them odd2, where no width is a whole number of
16-byte vectors.  `shift` moves a weight or operand one element past an aligned allocation
(contiguous, base not 16-byte aligned), so the kernels' per-row alignment tests and their
element fallbacks run on widths that would otherwise take the vector path.  Fixed regression
cases sit beside each test as @example."""
import pytest
import torch
from harness import shifted
from hypothesis import example, given, strategies as st

from kernel_cases import (kernel_test, DTYPES, MODEL_NAMES, Recorder, TType, act, empty_out, model, rand, reference,
                          run_kernel, single_op_graph, strided_view)

SETTINGS = kernel_test(25)
RECS = {f: Recorder(f) for f in ("embedding", "rms_norm", "fused_add_rms_norm", "add", "silu_and_mul")}
tokens = st.one_of(st.sampled_from([1, 2, 63, 64, 65]), st.integers(1, 300))


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for r in RECS.values():
        r.report()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), T=tokens, shift=st.booleans(),
       seed=st.integers(0, 2**31))
@example(name="odd2", dtype="bf16", T=65, shift=False, seed=1)
@example(name="odd2", dtype="fp32", T=1, shift=True, seed=2)
@example(name="lite", dtype="bf16", T=2, shift=True, seed=3)
def test_embedding(name, dtype, T, shift, seed):
    m = model(name)
    D, vocab = m.dims["hidden"], min(m.dims["vocab"], 4096)
    m_small = m if m.dims["vocab"] == vocab else None
    if m_small is None:  # keep the table small: a model with the same dims but a short vocab
        import dataclasses
        m_small = dataclasses.replace(m, dims_items=tuple((k, vocab if k == "vocab" else v) for k, v in m.dims_items))
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m_small, "embedding", {}, {"ids": TType(("T",), "i64")}, {"weight": "emb"})
    ids = torch.randint(0, vocab, (T,), generator=gen).cuda()
    table = shifted(rand((vocab, D), dtype, gen=gen), shift)
    out = empty_out((T, D), dtype)
    run_kernel(G, nid, dtype, values={"ids": ids, "out": out}, weights={"emb": table}, sizes={"T": T})
    (ref,) = reference(G, nid, [ids], {"emb": table})
    RECS["embedding"].check(out, ref, dtype)
    RECS["embedding"].example()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), T=tokens, which=st.sampled_from(["hidden", "kv_lora_rank"]),
       extra=st.sampled_from([0, 0, 3, 8, 64]), offset=st.integers(0, 64), shift=st.booleans(),
       magnitude=st.sampled_from([3.0, 3.0, 1e-3]), seed=st.integers(0, 2**31))
@example(name="odd2", dtype="bf16", T=64, which="hidden", extra=3, offset=1, shift=False, magnitude=3.0, seed=1)
@example(name="odd2", dtype="fp16", T=65, which="kv_lora_rank", extra=0, offset=0, shift=True, magnitude=3.0, seed=2)
@example(name="lite", dtype="bf16", T=63, which="kv_lora_rank", extra=64, offset=1, shift=True, magnitude=3.0, seed=3)
@example(name="lite", dtype="fp32", T=9, which="kv_lora_rank", extra=0, offset=0, shift=False, magnitude=1e-3, seed=4)
def test_rms_norm(name, dtype, T, which, extra, offset, shift, magnitude, seed):
    """magnitude 1e-3: rows whose mean square is about eps (1e-6), so a wrong eps shows."""
    m = model(name)
    n = m.dims[which]
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "rms_norm", {}, {"x": act(n)}, {"weight": "w"})
    x = strided_view(T, n, dtype, extra, offset, gen) * magnitude
    w = shifted(rand((n,), dtype, gen=gen) + 1, shift)
    out = empty_out((T, n), dtype)
    run_kernel(G, nid, dtype, values={"x": x, "out": out}, weights={"w": w}, sizes={"T": T})
    (ref,) = reference(G, nid, [x], {"w": w})
    RECS["rms_norm"].check(out, ref, dtype)
    RECS["rms_norm"].example()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), T=tokens, extra=st.sampled_from([0, 0, 5, 8]),
       offset=st.integers(0, 8), shift=st.booleans(), seed=st.integers(0, 2**31))
@example(name="odd2", dtype="bf16", T=65, extra=5, offset=3, shift=False, seed=1)
@example(name="odd2", dtype="fp32", T=2, extra=0, offset=0, shift=True, seed=2)
@example(name="lite", dtype="fp16", T=64, extra=8, offset=1, shift=True, seed=3)
def test_fused_add_rms_norm(name, dtype, T, extra, offset, shift, seed):
    m = model(name)
    n = m.dims["hidden"]
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "fused_add_rms_norm", {}, {"x": act(n), "r": act(n)}, {"weight": "w"})
    x = strided_view(T, n, dtype, extra, offset, gen)
    r = shifted(rand((T, n), dtype, gen=gen), shift)
    w = shifted(rand((n,), dtype, gen=gen) + 1, shift)
    h, s = shifted(empty_out((T, n), dtype), shift), shifted(empty_out((T, n), dtype), shift)
    run_kernel(G, nid, dtype, values={"x": x, "r": r, "out0": h, "out1": s}, weights={"w": w}, sizes={"T": T})
    # The reference adds in the activation type (the kernel rounds s before normalising).
    s_ref = (x + r)
    ref_h = reference(G, nid, [s_ref, torch.zeros_like(s_ref)], {"w": w})[0]
    RECS["fused_add_rms_norm"].check(s, (x.double() + r.double()), dtype, "s")
    RECS["fused_add_rms_norm"].check(h, ref_h, dtype, "h")
    RECS["fused_add_rms_norm"].example()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES + ("f32value",)), T=tokens,
       extra=st.sampled_from([0, 0, 3, 8]), offset=st.integers(0, 8), shift=st.booleans(), seed=st.integers(0, 2**31))
@example(name="odd2", dtype="bf16", T=65, extra=3, offset=1, shift=False, seed=1)
@example(name="odd2", dtype="f32value", T=1, extra=0, offset=0, shift=True, seed=2)
@example(name="lite", dtype="bf16", T=2, extra=0, offset=0, shift=True, seed=3)
def test_add(name, dtype, T, extra, offset, shift, seed):
    m = model(name)
    n = m.dims["hidden"]
    gen = torch.Generator().manual_seed(seed)
    vdt = "f32" if dtype == "f32value" else "act"
    tdt = "fp32" if dtype == "f32value" else dtype
    act_dtype = "bf16" if dtype == "f32value" else dtype
    G, nid = single_op_graph(m, "add", {}, {"a": TType(("T", n), vdt), "b": TType(("T", n), vdt)}, {})
    a = strided_view(T, n, tdt, extra, offset, gen)
    b = shifted(rand((T, n), tdt, gen=gen), shift)
    out = shifted(empty_out((T, n), tdt), shift)
    run_kernel(G, nid, act_dtype, values={"a": a, "b": b, "out": out}, sizes={"T": T})
    (ref,) = reference(G, nid, [a, b])
    RECS["add"].check(out, ref, tdt)
    RECS["add"].example()


@SETTINGS
@given(name=st.sampled_from(MODEL_NAMES), dtype=st.sampled_from(DTYPES), T=tokens, which=st.sampled_from(["intermediate", "moe_intermediate"]),
       fused=st.booleans(), shift=st.booleans(), seed=st.integers(0, 2**31))
@example(name="odd2", dtype="bf16", T=65, which="intermediate", fused=True, shift=False, seed=1)
@example(name="odd2", dtype="fp16", T=3, which="moe_intermediate", fused=False, shift=True, seed=2)
@example(name="lite", dtype="bf16", T=64, which="moe_intermediate", fused=True, shift=True, seed=3)
def test_silu_and_mul(name, dtype, T, which, fused, shift, seed):
    m = model(name)
    n = m.dims[which]
    gen = torch.Generator().manual_seed(seed)
    G, nid = single_op_graph(m, "silu_and_mul", {}, {"g": act(n), "u": act(n)}, {})
    if fused:  # gate and up as the two halves of one [T, 2n] projection
        gu = rand((T, 2 * n), dtype, gen=gen, scale=3)
        g, u = gu[:, :n], gu[:, n:]
    else:
        g, u = rand((T, n), dtype, gen=gen, scale=3), rand((T, n), dtype, gen=gen)
    out = shifted(empty_out((T, n), dtype), shift)
    run_kernel(G, nid, dtype, values={"g": g, "u": u, "out": out}, sizes={"T": T})
    (ref,) = reference(G, nid, [g, u])
    RECS["silu_and_mul"].check(out, ref, dtype)
    RECS["silu_and_mul"].example()
