"""The integer arithmetic of msModelSlim's W8A8 / W4A8 formats (ir/formats.py rows int8_* and int4_*).

One definition, shared by the reference semantics, the checkpoint writer and (later) the kernels' tests:

- Weights, per output channel o (``_scale`` s, ``_offset`` zero): W[o, i] = q[o, i] * s[o], q int8 (-128..127)
  or int4 (-8..7).  Per-group int4 adds a second stage s2 [O, I/G]: W[o, i] = (q[o, i] * s2[o, i // G]) * s[o].
- Packed int4 (two per byte along O): byte[j, i] = (q[2j+1, i] << 4) | (q[2j, i] & 0xF), stored as int8; the
  low nibble is the even row.  Unpacking sign-extends each nibble.
- Dynamic activations (per token): s_x[t] = max_i |x[t, i]| / 127 in float32 and
  q_x[t, i] = clamp(rne(x[t, i] / s_x[t]), -128, 127), rne = round half to even, as torch_npu's
  npu_dynamic_quant documents (scale = rowMax(|x|) / 127, y = round(x / scale); Ascend's float->int8 cast
  rounds to nearest even); a row of zeros has s_x = 0 and q_x = 0.
- Static activations (per tensor): q_x = clamp(rne(x * (1 / input_scale) + input_offset), -128, 127), the
  multiply form of npu_quantize that vllm-ascend's W8A8 calls.
- A linear: acc[t, o] = sum_i q_x[t, i] * q_w[o, i] exactly (int64); dynamic: y = (f32(acc) * s[o]) * s_x[t];
  static: y = f32(acc + quant_bias[o]) * deq_scale[o].  Per-group int4: the int8-domain weight
  q[o, i] * s2[o, i // G] (float32) times q_x, summed in float64, then the two scales as above.

Dimension legend: T tokens, O output channels, I input channels, G the int4 group (256).
"""
from __future__ import annotations

from .lazy import F, torch

INT8 = (-128, 127)
INT4 = (-8, 7)
SCALE_BIAS_DOWN_CHUNKS = 16   # msModelSlim writes down_proj's scale_bias as 16 partial sums along I


def _qrange(fmt) -> tuple[int, int]:
    return INT4 if fmt.storage == "int4" else INT8


def stored_shape(fmt, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored weight's shape for a logical W of `shape` [.., O, I] (packed int4 halves O)."""
    *lead, rows, cols = shape
    if rows % fmt.pack:
        raise ValueError(f"{fmt.name} packs {fmt.pack} rows per byte; {rows} output channels do not divide")
    return (*lead, rows // fmt.pack, cols)


def logical_shape(fmt, stored: tuple[int, ...]) -> tuple[int, ...]:
    *lead, rows, cols = stored
    return (*lead, rows * fmt.pack, cols)


def companion_shape(fmt, suffix: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of companion `suffix` of a logical W of `shape` [.., O, I]: [.., O, 1] per channel,
    [.., O, I / G] per group (I must divide into groups)."""
    *lead, rows, cols = shape
    if suffix.endswith("_second"):
        if cols % fmt.group:
            raise ValueError(f"{fmt.name} groups {fmt.group} input channels; {cols} do not divide")
        return (*lead, rows, cols // fmt.group)
    return (*lead, rows, 1)


def pack_int4(q):
    """int4 values q [.., O, I] (in -8..7, any integer dtype) -> int8 [.., O/2, I], two per byte along O."""
    q = q.to(torch.int16)
    lo, hi = q[..., 0::2, :], q[..., 1::2, :]
    byte = ((hi << 4) | (lo & 0xF)) & 0xFF
    return torch.where(byte > 127, byte - 256, byte).to(torch.int8)


def unpack_int4(packed):
    """int8 [.., O/2, I] -> int8 int4 values [.., O, I]: the low nibble is row 2j, the high row 2j+1,
    each sign-extended."""
    b = packed.to(torch.int16) & 0xFF
    lo, hi = b & 0xF, b >> 4
    lo, hi = torch.where(lo > 7, lo - 16, lo), torch.where(hi > 7, hi - 16, hi)
    out = torch.stack((lo, hi), dim=-2)                         # [.., O/2, 2, I]
    return out.reshape(*packed.shape[:-2], packed.shape[-2] * 2, packed.shape[-1]).to(torch.int8)


def int_values(stored, fmt):
    """The integer weight values q [.., O, I] (int8 tensor) a stored weight holds."""
    q = unpack_int4(stored) if fmt.pack == 2 else stored.to(torch.int8)
    lo, hi = _qrange(fmt)
    if fmt.storage == "int4" and fmt.pack == 1 and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"{fmt.name} stores one int4 per byte, but a byte holds {int(q.min())}..{int(q.max())}")
    return q


def _split(companions, fmt) -> dict:
    if len(companions) != len(fmt.companions):
        raise ValueError(f"{fmt.name} has {len(fmt.companions)} companions ({', '.join(fmt.companions)}), "
                         f"got {len(companions)}")
    return dict(zip(fmt.companions, companions))


def check_companions(stored, companions, fmt, *, values: bool = True) -> dict:
    """The companions by suffix, float32, after checking their shapes and (values) that the offsets are
    zero (msModelSlim's weights are symmetric); a ValueError says what is wrong.  values=False skips the
    one check that reads the tensors (a host sync: not allowed while a CUDA graph is captured), for
    weights the loader has checked."""
    c = _split(companions, fmt)
    shape = logical_shape(fmt, tuple(stored.shape))
    out = {}
    for suffix, t in c.items():
        want = companion_shape(fmt, suffix, shape)
        if tuple(t.shape) != want:
            raise ValueError(f"{fmt.name} companion {suffix} has shape {tuple(t.shape)}, expected {want} for a "
                             f"stored weight of shape {tuple(stored.shape)}")
        t = t.to(torch.float32)
        if values and "_offset" in suffix and bool((t != 0).any()):
            raise ValueError(f"{fmt.name} companion {suffix} is not zero: asymmetric weights are not supported")
        out[suffix] = t
    return out


def int8_domain(stored, companions, fmt):
    """float32 [.., O, I]: the weight before its per-channel scale -- q, or q * s2 per group."""
    c = check_companions(stored, companions, fmt)
    q = int_values(stored, fmt).to(torch.float32)
    if fmt.group:
        q = q * c["_scale_second"].repeat_interleave(fmt.group, dim=-1)
    return q


def dequantize_int(stored, companions, fmt):
    """The float32 weight [.., O, I]: (q [* s2]) * s, as the module docstring defines."""
    c = check_companions(stored, companions, fmt)
    return int8_domain(stored, companions, fmt) * c["_scale"]


def quantize_int(weight, fmt):
    """(stored, companions in fmt.companions order) for float `weight` [.., O, I], as msModelSlim writes them:
    per channel s = amax_i |W[o, i]| / qmax (127, or 7 for int4; an all-zero row gets s = 1), q = clamp(rne(W / s));
    per group first the int8 channel step, then per group of G inputs s2 = amax|q8| / 7, q = clamp(rne(q8 / s2)).
    Offsets are zeros."""
    w = weight.to(torch.float32)
    lo, hi = _qrange(fmt)
    *lead, rows, cols = w.shape
    if fmt.group:
        s = _amax_scale(w, 127.0)
        q8 = torch.round(w / s).clamp(*INT8)
        if cols % fmt.group:
            raise ValueError(f"{fmt.name} groups {fmt.group} input channels; {cols} do not divide")
        g = q8.reshape(*lead, rows, cols // fmt.group, fmt.group)
        s2 = _amax_scale(g, float(hi)).squeeze(-1)                 # [.., O, I/G]
        q = torch.round(g / s2.unsqueeze(-1)).clamp(lo, hi).reshape(w.shape)
        scales = {"_scale": s, "_offset": torch.zeros_like(s),
                  "_scale_second": s2, "_offset_second": torch.zeros_like(s2)}
    else:
        s = _amax_scale(w, float(hi))
        q = torch.round(w / s).clamp(lo, hi)
        scales = {"_scale": s, "_offset": torch.zeros_like(s)}
    q = q.to(torch.int8)
    stored = pack_int4(q) if fmt.pack == 2 else q
    return stored, tuple(scales[k] for k in fmt.companions)


def _amax_scale(w, qmax: float):
    amax = w.abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def scale_bias(stored, companions, fmt, chunks: int = 1):
    """float32 [.., O, chunks]: 8 * s[o] * sum_i q[o, i] (the int8-domain q for per-group), the sum split into
    `chunks` contiguous ranges of I -- what msModelSlim stores as a packed int4 linear's scale_bias (1 chunk
    for gate/up, SCALE_BIAS_DOWN_CHUNKS for down_proj).  Summed in float64."""
    c = check_companions(stored, companions, fmt)
    q = int8_domain(stored, companions, fmt).to(torch.float64)
    cols = q.shape[-1]
    bounds = [cols * j // chunks for j in range(chunks + 1)]
    sums = torch.stack([q[..., a:b].sum(-1) for a, b in zip(bounds, bounds[1:])], dim=-1)
    return (8.0 * sums * c["_scale"].to(torch.float64)).to(torch.float32)


def scale_bias_problem(found, stored, companions, fmt, rel: float = 1e-5) -> str | None:
    """Why a checkpoint's scale_bias `found` [.., O, k] is not 8 * s * sum_i q of its weight (compared per
    output channel, summed over its k columns, within `rel` of the row's sum of |terms|: a float32 sum
    of thousands of terms is that close), or None."""
    if found.dim() != stored.dim() or tuple(found.shape[:-1]) != logical_shape(fmt, tuple(stored.shape))[:-1]:
        rows = ", ".join(map(str, logical_shape(fmt, tuple(stored.shape))[:-1]))
        return f"has shape {tuple(found.shape)}, expected [{rows}, k]"
    want = scale_bias(stored, companions, fmt).to(torch.float64).squeeze(-1)
    got = found.to(torch.float64).sum(-1)
    c = check_companions(stored, companions, fmt)
    bound = 8.0 * int8_domain(stored, companions, fmt).to(torch.float64).abs().sum(-1) \
        * c["_scale"].to(torch.float64).squeeze(-1).abs()
    bad = (got - want).abs() > rel * bound + 1e-30
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        return (f"is not 8 * weight_scale * sum(weight) at output channel {idx}: {float(got[idx]):.6g} stored, "
                f"{float(want[idx]):.6g} from the weight")
    return None


def quantize_activation(x):
    """(q int8 [T, I], s float32 [T, 1]): per-token symmetric dynamic quantisation (module docstring)."""
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: torch on CUDA divides by a Python scalar as a multiply by its reciprocal, which
    # differs from the true quotient in the last bit for some values (the kernels divide: quant_int8.cuh)
    s = amax / torch.full_like(amax, 127.0)
    q = torch.round(xf / torch.where(s > 0, s, torch.ones_like(s))).clamp(*INT8)
    return q.to(torch.int8), s


def qrow(k: int) -> int:
    """Bytes of one quantised row as the int8 kernels read it: k rounded up to 16 (zero padded, so a row
    is whole 16-byte loads; templates/include/quant_int8.cuh qrow)."""
    return -(-k // 16) * 16


def quantized_rows(x):
    """(q int32 [T, qrow(I) / 4], s float32 [T]): quantize_activation(x) in the kernels' layout, the int8
    row zero padded to qrow(I) bytes and read four bytes a word (little-endian) -- what an RMSNorm writes
    for its int8 readers (ir/passes/fuse_norm_int8_quant.py)."""
    q, s = quantize_activation(x)
    q = F.pad(q, (0, qrow(q.shape[-1]) - q.shape[-1]))
    return q.contiguous().view(torch.int32), s.reshape(-1)


def quantize_activation_static(x, input_scale, input_offset):
    """int8 [T, I]: per-tensor static quantisation, q = clamp(rne(x * (1 / input_scale) + input_offset))."""
    inv = 1.0 / input_scale.to(torch.float32).reshape(())
    q = torch.round(x.to(torch.float32) * inv + input_offset.to(torch.float32).reshape(()))
    return q.clamp(*INT8).to(torch.int8)


def int_matmul(qx, qw):
    """Exact sum_i qx[t, i] * qw[o, i] (int64 [T, O]) for int8 qx [T, I], qw [O, I].  On CUDA (no int64
    GEMM there): torch._int_mm's int32 sums where its shape rules hold (T > 16, I and O multiples of 8;
    exact below I = 2^17), else float64 sums (exact: every partial sum is an integer below 2^53)."""
    if qx.is_cuda:
        (T, I), O = qx.shape, qw.shape[0]
        if T > 16 and I % 8 == 0 and O % 8 == 0 and I < (1 << 17):
            return torch._int_mm(qx.to(torch.int8).contiguous(), qw.to(torch.int8).contiguous().T).to(torch.int64)
        return (qx.to(torch.float64) @ qw.to(torch.float64).T).to(torch.int64)
    return qx.to(torch.int64) @ qw.to(torch.int64).T


def int_linear(x, stored, companions, fmt, siblings: dict | None = None, *, check_values: bool = True):
    """y float32 [T, O] = the quantised linear x [T, I] @ W^T with `fmt`'s exact arithmetic (module docstring).
    `siblings`: static W8A8's input_scale, input_offset, quant_bias, deq_scale by leaf name.  check_values:
    check_companions' `values` (False: no host sync, for checked weights inside a captured CUDA graph)."""
    c = check_companions(stored, companions, fmt, values=check_values)
    if fmt.activation == "tensor":
        s = siblings or {}
        qx = quantize_activation_static(x, s["input_scale"], s["input_offset"])
        acc = int_matmul(qx, int_values(stored, fmt)) + s["quant_bias"].to(torch.int64).reshape(1, -1)
        return acc.to(torch.float32) * s["deq_scale"].to(torch.float32).reshape(1, -1)
    qx, sx = quantize_activation(x)
    if fmt.group:
        acc = (qx.to(torch.float64) @ int8_domain(stored, companions, fmt).to(torch.float64).T).to(torch.float32)
    else:
        acc = int_matmul(qx, int_values(stored, fmt)).to(torch.float32)
    return (acc * c["_scale"].reshape(1, -1)) * sx


# The ops whose reference multiplies a bound weight only through linear() below: where an integer format may bind.
INT_OPS = ("linear", "multi_linear", "gate_up_silu", "moe_gate_up", "moe_gate_up_silu", "moe_down", "moe_expert_ffn")


class IntMatrix:
    """A bound integer weight as an op's reference semantics takes it: `stored` [.., O/pack, I] with its
    companions (in fmt.companions order); indexing picks experts, linear() is int_linear in x's dtype.
    checked: the loader checked the companions' values (linear() then reads none on the host)."""

    def __init__(self, stored, companions, fmt, *, checked: bool = False):
        self.stored, self.companions, self.fmt, self.checked = stored, tuple(companions), fmt, checked

    @property
    def shape(self):
        return torch.Size(logical_shape(self.fmt, tuple(self.stored.shape)))

    def __getitem__(self, index):
        return IntMatrix(self.stored[index], [c[index] for c in self.companions], self.fmt, checked=self.checked)

    def linear(self, x):
        return int_linear(x, self.stored, self.companions, self.fmt, check_values=not self.checked).to(x.dtype)


def linear(x, w):
    """F.linear(x, w) -- or, for an IntMatrix, the exact integer linear its format defines."""
    if isinstance(w, IntMatrix):
        return w.linear(x)
    return F.linear(x, w)


__all__ = ["INT_OPS", "IntMatrix", "linear", "INT4", "INT8", "SCALE_BIAS_DOWN_CHUNKS", "check_companions",
           "companion_shape", "dequantize_int",
           "int8_domain", "int_linear", "int_matmul", "int_values", "logical_shape", "pack_int4",
           "quantize_activation", "quantize_activation_static", "quantize_int", "scale_bias", "scale_bias_problem",
           "stored_shape", "unpack_int4"]
