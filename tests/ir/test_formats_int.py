"""ir/formats_int.py: msModelSlim's int8 / int4 weight formats and the int8 activation arithmetic."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ir.formats import FORMATS, INT_FORMATS, dequantize, quantize, set_format
from ir.formats_int import (companion_shape, int_linear, int_matmul, int_values, pack_int4, quantize_activation,
                            quantize_activation_static, scale_bias, scale_bias_problem, stored_shape, unpack_int4)
from ir.ops.base import WeightInfo, WeightSlice


def _w(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 0.2


def test_two_int4_per_byte_along_the_output_dim_low_nibble_first():
    q = torch.tensor([[-1, 3], [2, -8]], dtype=torch.int8)            # rows 0, 1 -> one byte row
    packed = pack_int4(q)
    assert packed.dtype == torch.int8 and packed.shape == (1, 2)
    assert packed.tolist() == [[0x2F, 0x83 - 256]]                     # (q[1] << 4) | (q[0] & 0xF)
    every = torch.arange(-8, 8, dtype=torch.int8)
    grid = torch.stack(torch.meshgrid(every, every, indexing="ij")).reshape(2, -1)   # all 256 pairs
    assert torch.equal(unpack_int4(pack_int4(grid)), grid)
    assert torch.equal(unpack_int4(pack_int4(grid)[None]), grid[None])   # leading (expert) dims kept


@pytest.mark.parametrize("fmt", INT_FORMATS, ids=lambda f: f.name)
def test_quantize_then_dequantize_is_within_half_a_step(fmt):
    w = _w(6, 512, seed=1)
    w[2] = 0                                                             # an all-zero row gets scale 1
    stored, comps = quantize(w, fmt)
    assert stored.dtype == torch.int8 and tuple(stored.shape) == stored_shape(fmt, (6, 512))
    for suffix, c in zip(fmt.companions, comps):
        assert c.dtype == torch.float32 and tuple(c.shape) == companion_shape(fmt, suffix, (6, 512))
    back = dequantize(stored, comps, fmt)
    q = int_values(stored, fmt)
    lo, hi = (-8, 7) if fmt.storage == "int4" else (-128, 127)
    assert int(q.min()) >= lo and int(q.max()) <= hi
    step = comps[0] * (comps[2].repeat_interleave(256, -1) if fmt.group else 1)
    err = (back - w).abs()
    slack = 0.5 * 127 / 7 * comps[0] if fmt.group else 0   # the int8 step's rounding, seen through the int4 step
    assert bool((err <= 0.5 * step * (1 + 1e-5) + slack + 1e-12).all())
    assert bool((back[2] == 0).all())


def test_nonzero_weight_offsets_are_refused():
    fmt = FORMATS["int8_channel"]
    stored, (s, off) = quantize(_w(4, 8), fmt)
    with pytest.raises(ValueError, match="asymmetric"):
        dequantize(stored, (s, off + 1), fmt)
    with pytest.raises(ValueError, match="shape"):
        dequantize(stored, (s[:3], off[:3]), fmt)


def test_dynamic_activation_quantisation_rounds_half_to_even_per_token():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5, 1.5], [0, 0, 0, 0, 0, 0], [-254.0, 1.0, 3.0, 5.0, 0, 0]])
    q, s = quantize_activation(x.to(torch.bfloat16))
    assert s.dtype == torch.float32 and s.squeeze(1).tolist() == [1.0, 0.0, 2.0]
    assert q.dtype == torch.int8
    assert q.tolist() == [[127, 2, 4, -2, 0, 2], [0] * 6, [-127, 0, 2, 2, 0, 0]]   # 0.5 -> 0, 1.5 -> 2, 2.5 -> 2


def test_static_activation_quantisation_multiplies_by_the_inverse_scale_and_adds_the_offset():
    x = torch.tensor([[1.0, -3.0, 100.0, 0.25]])
    q = quantize_activation_static(x, torch.tensor([0.5]), torch.tensor([3], dtype=torch.int8))
    assert q.tolist() == [[5, -3, 127, 4]]                             # 2+3, -6+3, saturated, rne(3.5) = 4


@pytest.mark.parametrize("name", ["int8_channel", "int4_channel", "int4_channel_byte"])
def test_int_linear_is_the_exact_integer_product_then_the_two_scales(name):
    fmt = FORMATS[name]
    w, x = _w(10, 48, seed=2), torch.randn(5, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    stored, comps = quantize(w, fmt)
    y = int_linear(x, stored, comps, fmt)
    qx, sx = quantize_activation(x)
    acc = int_matmul(qx, int_values(stored, fmt))
    assert acc.dtype == torch.int64
    want = (acc.double() * comps[0].double().reshape(1, -1)) * sx.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=0)
    # and it is close to the float product (the quantisation's own error)
    ref = x.float() @ w.T
    assert float((y - ref).norm() / ref.norm()) < (0.25 if fmt.storage == "int4" else 0.02)   # int4: ~amax/7/sqrt(12)


def test_int_linear_static_adds_quant_bias_before_deq_scale():
    fmt = FORMATS["int8_static"]
    w, x = _w(7, 16, seed=3), torch.randn(3, 16, generator=torch.Generator().manual_seed(8))
    stored, comps = quantize(w, fmt)
    in_s, in_off = torch.tensor([x.abs().max() / 120]), torch.tensor([2], dtype=torch.int8)
    qsum = int_values(stored, fmt).to(torch.int64).sum(1)
    sib = {"input_scale": in_s, "input_offset": in_off, "quant_bias": (-2 * qsum).to(torch.int32),
           "deq_scale": (in_s * comps[0].squeeze(1)).to(torch.float32)}
    y = int_linear(x, stored, comps, fmt, sib)
    assert float((y - x @ w.T).norm() / (x @ w.T).norm()) < 0.02


@pytest.mark.parametrize("name", ["int4_channel", "int4_group256_packed"])
def test_scale_bias_checksum_catches_mutants(name):
    fmt = FORMATS[name]
    stored, comps = quantize(_w(8, 512, seed=4), fmt)
    sb = scale_bias(stored, comps, fmt)
    assert sb.shape == (8, 1)
    q = int_values(stored, fmt).double()
    if not fmt.group:
        torch.testing.assert_close(sb.double(), 8 * comps[0].double() * q.sum(1, keepdim=True), rtol=1e-6, atol=0)
    assert scale_bias_problem(sb, stored, comps, fmt) is None
    assert scale_bias_problem(scale_bias(stored, comps, fmt, 16), stored, comps, fmt) is None   # down_proj's 16 chunks
    assert scale_bias_problem(sb * 1.01, stored, comps, fmt) is not None
    swapped = pack_int4(unpack_int4(stored).reshape(4, 2, 512).flip(1).reshape(8, 512))   # nibbles swapped
    assert scale_bias_problem(sb, swapped, comps, fmt) is not None
    assert "shape" in scale_bias_problem(sb[:4], stored, comps, fmt)


def test_integer_formats_bind_per_channel_companions_and_refuse_what_they_cannot_mean():
    W = {"x.weight": WeightInfo((6, 4))}
    set_format(W, "x.weight", FORMATS["int8_channel"])
    assert W["x.weight_scale"] == W["x.weight_offset"] == WeightInfo((6, 1), True)
    parts = (WeightSlice("s.up.weight", 0, 14, 28, (28, 44)), "e.0.up.weight")
    W = {"e.*.up.weight": WeightInfo((2, 14, 44), parts=parts)}
    set_format(W, "e.*.up.weight", FORMATS["int4_channel"])
    assert W["e.*.up.weight_scale"].parts == (WeightSlice("s.up.weight_scale", 0, 14, 28, (28, 1)),
                                             "e.0.up.weight_scale")
    down = {"e.*.down.weight": WeightInfo((1, 44, 14), parts=(WeightSlice("s.down.weight", 1, 0, 14, (44, 28)),))}
    with pytest.raises(ValueError, match="slice of input columns"):
        set_format(down, "e.*.down.weight", FORMATS["int8_channel"])
    with pytest.raises(ValueError, match="static W8A8"):
        set_format({"x.weight": WeightInfo((4, 4))}, "x.weight", FORMATS["int8_static"])


@settings(max_examples=25, deadline=None)
@given(t=st.integers(1, 9), i=st.integers(1, 70), half_o=st.integers(1, 12), seed=st.integers(0, 2**16),
       name=st.sampled_from(["int8_channel", "int4_channel", "int4_channel_byte"]))
def test_int_linear_property_odd_widths(t, i, half_o, seed, name):
    """Any widths (packed int4: an even O): the integer product is exact, the scales applied in float32 after
    it, and the token rows quantised independently of each other (a row alone gives the same output)."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(seed)
    o = 2 * half_o - (0 if fmt.pack == 2 else seed % 2)
    w, x = torch.randn(o, i, generator=g), torch.randn(t, i, generator=g) * 3
    stored, comps = quantize(w, fmt)
    y = int_linear(x, stored, comps, fmt)
    qx, sx = quantize_activation(x)
    assert bool((qx.abs() <= 127).all()) and bool((qx.abs().amax(1) == 127).all())
    want = (int_matmul(qx, int_values(stored, fmt)).double() * comps[0].double().reshape(1, -1)) * sx.double()
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(int_linear(x[-1:], stored, comps, fmt), y[-1:], rtol=0, atol=0)
