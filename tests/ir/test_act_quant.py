"""The FP8 activation quantiser's reference (ir/act_quant.py) against its definition, on the CPU:
per token per 128 columns, s = max(amax, floor) / 448, q = e4m3(x / s) rounded to the nearest e4m3
value (ties to an even mantissa), saturated; and the FP8 x FP8 product against a block-by-block sum."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from ir.act_quant import AMAX_FLOOR, dequantize_weight_fp8, linear_fp8, quantize_act_fp8
from ir.formats import FP8_BLOCK, FP8_MAX, cdiv

# every finite e4m3 value, as float64, sorted, with its byte's mantissa parity (for ties)
_BYTES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
_FINITE = ~torch.isnan(_BYTES)
_VALUES, _ORDER = _BYTES[_FINITE].sort()
_ODD = (torch.arange(256)[_FINITE][_ORDER] & 1).bool()


def _nearest_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round each fp32 value of y to the nearest finite e4m3 value by search (ties: the even
    mantissa), saturating past +-448: the definition, independent of torch's conversion."""
    y = y.double().clamp(-FP8_MAX, FP8_MAX).flatten()
    d = (y[:, None] - _VALUES[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    tied = d == best
    pick = torch.where(tied & ~_ODD[None, :], 1, 0) * 2 + tied.int()   # an even tied value first
    return _VALUES[pick.argmax(dim=1)]


def _x(T, K, seed, spread):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.rand(T, 1, generator=gen) * spread - spread / 2)
    return (torch.randn(T, K, generator=gen) * rows).to(torch.bfloat16)


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 9), K=st.sampled_from([16, 48, 128, 144, 256, 576, 720, 1040]), seed=st.integers(0, 2**31),
       spread=st.sampled_from([0.0, 8.0, 40.0]))
def test_the_quantiser_is_its_definition(T, K, seed, spread):
    x = _x(T, K, seed, spread)
    q, s = quantize_act_fp8(x)
    KB = cdiv(K, FP8_BLOCK)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (T, K) and s.dtype == torch.float32 and s.shape == (T, KB)
    xf = x.float()
    for g in range(KB):
        part = xf[:, g * FP8_BLOCK:(g + 1) * FP8_BLOCK]
        # fp32 division, correctly rounded: the float64 quotient rounded once to fp32 (exact for
        # division: 53 >= 2 x 24 + 2 bits), independent of torch's fp32 division
        want_s = (part.abs().amax(dim=1).clamp_min(AMAX_FLOOR).double() / FP8_MAX).float()
        assert torch.equal(s[:, g], want_s)
        want_q = _nearest_e4m3((part.double() / want_s[:, None].double()).float()).view(part.shape)
        assert torch.equal(q[:, g * FP8_BLOCK:(g + 1) * FP8_BLOCK].double(), want_q)
    # each group's largest element lands on +-448 (the whole e4m3 range is used)
    padded = torch.nn.functional.pad(q.double().abs(), (0, KB * FP8_BLOCK - K)).view(T, KB, FP8_BLOCK)
    assert torch.equal(padded.amax(dim=-1), torch.full((T, KB), FP8_MAX, dtype=torch.float64))


def test_ties_round_to_even_and_zero_groups_stay_zero():
    # in [256, 448] e4m3 steps by 32: 272 (= 256 + 16) ties between 256 (even) and 288 (odd)
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 2] = 448.0, 272.0, 304.0      # s = 1: 272 -> 256, 304 -> 320 (both even)
    q, s = quantize_act_fp8(x)
    assert s[0, 0] == 1.0 and q[0, :3].float().tolist() == [448.0, 256.0, 320.0]
    assert torch.equal(s[1], torch.full((2,), AMAX_FLOOR / FP8_MAX)) and not q[1].float().any()
    assert torch.equal(s[0, 1], torch.tensor(AMAX_FLOOR / FP8_MAX))


def test_a_ceil_group_takes_only_the_columns_that_exist():
    x = _x(3, 130, 7, 4.0)
    q, s = quantize_act_fp8(x)
    assert torch.equal(s[:, 1], x[:, 128:].float().abs().amax(dim=1) / FP8_MAX)
    assert torch.equal(q[:, :128], quantize_act_fp8(x[:, :128])[0])


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 5), K=st.sampled_from([32, 128, 200, 384]), O=st.sampled_from([1, 64, 130, 257]),
       seed=st.integers(0, 2**31))
def test_the_fp8_product_is_the_sum_of_its_scaled_blocks(T, K, O, seed):
    gen = torch.Generator().manual_seed(seed)
    qx, sx = quantize_act_fp8(_x(T, K, seed, 8.0))
    qw = (torch.randn(O, K, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    sw = torch.rand(cdiv(O, FP8_BLOCK), cdiv(K, FP8_BLOCK), generator=gen) + 0.5
    want = torch.zeros(T, O, dtype=torch.float64)
    for kb in range(cdiv(K, FP8_BLOCK)):
        ks = slice(kb * FP8_BLOCK, (kb + 1) * FP8_BLOCK)
        dot = qx[:, ks].double() @ qw[:, ks].double().T
        want += dot * sx[:, kb, None].double() * sw[torch.arange(O) // FP8_BLOCK, kb][None, :].double()
    torch.testing.assert_close(linear_fp8(qx, sx, qw, sw), want, rtol=1e-12, atol=1e-9)
    assert dequantize_weight_fp8(qw, sw).shape == (O, K)


@settings(max_examples=15, deadline=None)
@given(T=st.integers(1, 12), K=st.integers(1, 4), E=st.integers(1, 5), KD=st.sampled_from([16, 128, 144, 272]),
       N=st.sampled_from([1, 37, 128, 200]), seed=st.integers(0, 2**31))
def test_the_grouped_fp8_product_is_each_pairs_own_fp8_product(T, K, E, KD, N, seed):
    """grouped_linear_fp8 (the expert GEMMs' reference): pair p is linear_fp8 of its row and its expert's
    weight; a pair of another rank's expert (-1) stays zero.  Rows per token (gate_up) or per pair (down)."""
    from ir.act_quant import dequantize_experts_fp8, grouped_linear_fp8
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, cdiv(N, FP8_BLOCK) * FP8_BLOCK, cdiv(KD, FP8_BLOCK) * FP8_BLOCK, generator=g)
    s = w.abs().view(E, cdiv(N, FP8_BLOCK), FP8_BLOCK, -1, FP8_BLOCK).amax(dim=(2, 4)) / FP8_MAX
    q = (w / s.repeat_interleave(FP8_BLOCK, 1).repeat_interleave(FP8_BLOCK, 2))[:, :N, :KD].to(torch.float8_e4m3fn)
    experts = torch.randint(-1, E, (T * K,), generator=g)
    for per_token in (True, False):
        x = _x(T if per_token else T * K, KD, seed, 8.0)
        qx, sx = quantize_act_fp8(x)
        rows = torch.arange(T * K) // K if per_token else torch.arange(T * K)
        y = grouped_linear_fp8(qx, sx, rows, experts, q, s)
        for p in range(T * K):
            e, r = int(experts[p]), int(rows[p])
            want = torch.zeros(N, dtype=torch.float64) if e < 0 else \
                linear_fp8(qx[r:r + 1], sx[r:r + 1], q[e], s[e])[0]
            torch.testing.assert_close(y[p], want, rtol=1e-12, atol=1e-12)
    for e in range(E):
        torch.testing.assert_close(dequantize_experts_fp8(q, s)[e], dequantize_weight_fp8(q[e], s[e]))
