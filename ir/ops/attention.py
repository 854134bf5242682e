"""MLA: rotary embedding, the latent cache write, and attention (generic and lowered per phase).

Cache rows are ``[c_n (C) | k_rot (R)]``, 576 wide for DeepSeek.  The generic ``mla_attention``
reads the cache (so it means the same thing in prefill and decode); the passes lower it to
``mla_gather_context -> linear(kv_b) -> mla_prefill_attention`` (gather each sequence's context rows
from the cache, decompress them with kv_b, causal attention) or to ``mla_q_absorb ->
mla_decode_attention -> mla_v_up`` (attend over the compressed rows, never decompressing them).
"""
from __future__ import annotations

from .. import rope as rope_math
from ..lazy import torch
from .base import Attr, OpDef, TType, expect, register, same_rows
from .core import norm_quant_ref, norm_quant_types

PAIRS = ("adjacent", "halves")
OUTPUTS = ("interleaved", "halves")


def _kv_b_shape(model):
    d = model.dims
    return (d["heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"]), d["kv_lora_rank"])


def split_kv_b(kv_b: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b [H*(N+V), C] -> W_UK [H, N, C], W_UV [H, V, C]."""
    d = model.dims
    H, N = d["heads"], d["qk_nope_head_dim"]
    w = kv_b.view(H, N + d["v_head_dim"], d["kv_lora_rank"])
    return w[:, :N, :], w[:, N:, :]


def _rope_attrs():
    return {"pairs": Attr("choice", "adjacent", PAIRS), "output": Attr("choice", "interleaved", OUTPUTS)}


def _rotate(node, x, ctx, model):
    R = model.dims["qk_rope_head_dim"]
    cos, sin = rope_math.cos_sin(model.rope, R, ctx.positions.to(x.device))
    return rope_math.rotate(x, cos, sin, node.attrs["pairs"], node.attrs["output"])


@register
class Rope(OpDef):
    name = "rope"
    inputs = 2
    outputs = 2
    attrs = _rope_attrs()
    doc = "[q_pe [T, H, R], k_pe [T, R]] -> rotated by each token's position (YaRN tables)"

    @classmethod
    def infer(cls, node, ins, model):
        q, k = ins
        R = model.dims["qk_rope_head_dim"]
        expect(len(q.shape) == 3 and q.shape[2] == R, f"rope expects q_pe [T, H, {R}], got {q}")
        expect(k.shape == (q.shape[0], R), f"rope expects k_pe [T, {R}], got {k}")
        expect(R % 2 == 0, f"qk_rope_head_dim must be even, got {R}")
        return [q, k], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [_rotate(node, ins[0], ctx, node.model), _rotate(node, ins[1], ctx, node.model)]


@register
class RopeQ(OpDef):
    name = "rope_q"
    attrs = _rope_attrs()
    doc = "q_pe [T, H, R] -> rotated (the query half of rope, after split_rope)"

    @classmethod
    def infer(cls, node, ins, model):
        (q,) = ins
        expect(len(q.shape) == 3 and q.shape[2] == model.dims["qk_rope_head_dim"], f"rope_q expects [T, H, R], got {q}")
        return [q], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [_rotate(node, ins[0], ctx, node.model)]


@register
class RopeK(OpDef):
    name = "rope_k"
    attrs = _rope_attrs()
    doc = "k_pe [T, R] -> rotated (the key half of rope, after split_rope)"

    @classmethod
    def infer(cls, node, ins, model):
        (k,) = ins
        expect(len(k.shape) == 2 and k.shape[1] == model.dims["qk_rope_head_dim"], f"rope_k expects [T, R], got {k}")
        return [k], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [_rotate(node, ins[0], ctx, node.model)]


def _write_cache(ctx, layer: int, c_n: torch.Tensor, k_rot: torch.Tensor):
    cache = ctx.kv_cache[layer]
    rows = torch.cat([c_n, k_rot], dim=-1).to(cache.dtype)
    cache.view(-1, cache.shape[-1])[ctx.slot_mapping.to(cache.device)] = rows
    return cache


@register
class CacheWrite(OpDef):
    name = "cache_write"
    inputs = 2
    doc = "concat_and_cache_mla: [c_n [T, C], k_rot [T, R]] -> cache rows at slot_mapping (state)"

    @classmethod
    def infer(cls, node, ins, model):
        c, k = ins
        d = model.dims
        expect(c.shape[1:] == (d["kv_lora_rank"],) and c.dtype == "act", f"cache_write expects c_n [T, C], got {c}")
        expect(k.shape[1:] == (d["qk_rope_head_dim"],), f"cache_write expects k_rot [T, R], got {k}")
        same_rows(c, k, "cache_write")
        return [TType(("cache",), "state")], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [_write_cache(ctx, node.layer, ins[0], ins[1])]


@register
class MlaKvCacheWrite(OpDef):
    name = "mla_kv_cache_write"
    inputs = 2
    outputs = 3
    attrs = {"eps": Attr("float", None, positive=True), **_rope_attrs()}
    weights = {"norm": True}
    doc = "[c [T, C], k_pe [T, R]] -> [c_n, k_rot, state]: kv_a_layernorm + rope on k + cache write in one op"

    @classmethod
    def infer(cls, node, ins, model):
        c, k = ins
        d = model.dims
        expect(c.shape[1:] == (d["kv_lora_rank"],), f"mla_kv_cache_write expects c [T, C], got {c}")
        expect(k.shape[1:] == (d["qk_rope_head_dim"],), f"mla_kv_cache_write expects k_pe [T, R], got {k}")
        return [c, k, TType(("cache",), "state")], {"norm": (d["kv_lora_rank"],)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        from .core import rms_norm_ref
        c_n = rms_norm_ref(ins[0], w["norm"], node.attrs["eps"])
        k_rot = _rotate(node, ins[1], ctx, node.model)
        return [c_n, k_rot, _write_cache(ctx, node.layer, c_n, k_rot)]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Tq, H, dk], k [L, H, dk] (or [L, dk]), v [L, H, dv] (or [L, dv]); key j visible to query i iff j <= pos_i."""
    qf, kf, vf = q.double(), k.double(), v.double()
    if kf.dim() == 2:
        scores = torch.einsum("thd,ld->htl", qf, kf)
    else:
        scores = torch.einsum("thd,lhd->htl", qf, kf)
    L = k.shape[0]
    mask = torch.arange(L, device=q.device)[None, :] > q_pos.to(q.device)[:, None]  # [Tq, L]
    scores = (scores * scale).masked_fill(mask[None], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if vf.dim() == 2:
        out = torch.einsum("htl,ld->thd", p, vf)
    else:
        out = torch.einsum("htl,lhd->thd", p, vf)
    return out


@register
class MlaAttention(OpDef):
    name = "mla_attention"
    scaled_weights = ("kv_b",)
    inputs = 3
    weights = {"kv_b": True}
    doc = "[q_nope [T, H, N], q_rot [T, H, R], state] -> o [T, H*V]: causal attention over the sequence's cache rows"

    @classmethod
    def infer(cls, node, ins, model):
        qn, qr, st = ins
        d = model.dims
        H, N, R, V = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        expect(qn.shape[1:] == (H, N), f"mla_attention expects q_nope [T, {H}, {N}], got {qn}")
        expect(qr.shape[1:] == (H, R), f"mla_attention expects q_rot [T, {H}, {R}], got {qr}")
        expect(st.dtype == "state", f"mla_attention's third input must be the cache state from cache_write, got {st}")
        return [TType((qn.shape[0], H * V), "act")], {"kv_b": _kv_b_shape(model)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        model = node.model
        d = model.dims
        H, N, V, C = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
        q = torch.cat([ins[0], ins[1]], dim=-1)
        out = torch.empty(q.shape[0], H, V, dtype=torch.float64, device=q.device)
        for b, (s, e) in enumerate(ctx.query_ranges()):
            rows = ctx.gather_rows(node.layer, b).to(q.device)
            kv = torch.nn.functional.linear(rows[:, :C].to(w["kv_b"].dtype), w["kv_b"]).view(-1, H, N + V)
            k = torch.cat([kv[..., :N], rows[:, None, C:].to(kv.dtype).expand(-1, H, -1)], dim=-1)
            out[s:e] = _attend(q[s:e], k, kv[..., N:], ctx.positions[s:e], model.softmax_scale)
        return [out.to(ins[0].dtype).reshape(q.shape[0], H * V)]


@register
class MlaGatherContext(OpDef):
    """Each sequence's cache rows 0 .. context_len - 1 (its cached prefix and the rows this step
    wrote), packed sequence after sequence: what a prefill chunk attends to.  TK, the rows of the
    step, is the sum of the context lengths (a whole prompt's TK is its T)."""
    name = "mla_gather_context"
    doc = "state -> rows [TK, C+R]: every sequence's cache rows, in position order, sequence after sequence"

    @classmethod
    def infer(cls, node, ins, model):
        (st,) = ins
        d = model.dims
        expect(st.dtype == "state", f"mla_gather_context reads the cache state from a cache write, got {st}")
        return [TType(("TK", d["kv_lora_rank"] + d["qk_rope_head_dim"]), "act")], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [torch.cat([ctx.gather_rows(node.layer, b) for b in range(ctx.num_seqs)])]


KEYS = ("step", "context")


@register
class MlaPrefillAttention(OpDef):
    """Causal attention of each sequence's new tokens over decompressed keys and values.

    keys "step": a sequence's keys are its own tokens (the rows of kv / k_rot its queries sit at;
    the sequence starts at position 0 or the keys before its first token are not seen).
    keys "context": kv / k_rot hold every sequence's whole context (mla_gather_context's rows,
    decompressed: TK of them, context_lens[b] for sequence b), so a chunk of a long prompt after
    the first, or a decode token in a mixed step, sees the rows earlier steps cached; query i sees
    key j iff j <= positions[i]."""
    name = "mla_prefill_attention"
    inputs = 4
    attrs = {"keys": Attr("choice", "step", KEYS)}
    doc = ("[q_nope [T, H, N], q_rot [T, H, R], kv [T or TK, H*(N+V)], k_rot [T or TK, R]] -> o [T, H*V]: "
           "causal over each sequence's keys (its new tokens, or with keys=context its whole context)")

    @classmethod
    def infer(cls, node, ins, model):
        qn, qr, kv, kr = ins
        d = model.dims
        H, N, R, V = d["heads"], d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"]
        expect(qn.shape[1:] == (H, N) and qr.shape[1:] == (H, R), f"mla_prefill_attention: bad query {qn}, {qr}")
        expect(kv.shape[1:] == (H * (N + V),), f"mla_prefill_attention expects kv [T, {H * (N + V)}], got {kv}")
        expect(kr.shape[1:] == (R,), f"mla_prefill_attention expects k_rot [T, {R}], got {kr}")
        same_rows(kv, kr, "mla_prefill_attention's keys")
        return [TType((qn.shape[0], H * V), "act")], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        d = node.model.dims
        H, N, V = d["heads"], d["qk_nope_head_dim"], d["v_head_dim"]
        qn, qr, kv, kr = ins
        q = torch.cat([qn, qr], dim=-1)
        kv = kv.view(-1, H, N + V)
        k = torch.cat([kv[..., :N], kr[:, None, :].expand(-1, H, -1)], dim=-1)
        out = torch.empty(q.shape[0], H, V, dtype=torch.float64, device=q.device)
        context = node.attrs["keys"] == "context"
        ks = 0
        for b, (s, e) in enumerate(ctx.query_ranges()):
            if context:
                # keys at positions 0 .. context_len - 1
                n = ctx.context_lens[b]
                keys = slice(ks, ks + n)
                ks += n
                pos = ctx.positions[s:e]
            else:
                # keys are the sequence's own tokens, from its first
                keys = slice(s, e)
                pos = ctx.positions[s:e] - ctx.positions[s]
            out[s:e] = _attend(q[s:e], k[keys], kv[keys, :, N:], pos, node.model.softmax_scale)
        return [out.to(qn.dtype).reshape(q.shape[0], H * V)]


@register
class MlaQAbsorb(OpDef):
    name = "mla_q_absorb"
    scaled_weights = ("kv_b",)
    weights = {"kv_b": True}
    doc = "q_nope [T, H, N] -> q_lat [T, H, C] = q_nope @ W_UK (the K half of kv_b absorbed into the query)"

    @classmethod
    def infer(cls, node, ins, model):
        (qn,) = ins
        d = model.dims
        expect(qn.shape[1:] == (d["heads"], d["qk_nope_head_dim"]), f"mla_q_absorb expects q_nope [T, H, N], got {qn}")
        return [TType((qn.shape[0], d["heads"], d["kv_lora_rank"]), "act")], {"kv_b": _kv_b_shape(model)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        w_uk, _ = split_kv_b(w["kv_b"], node.model)
        return [torch.einsum("thn,hnc->thc", ins[0], w_uk)]


@register
class MlaDecodeQuery(OpDef):
    name = "mla_decode_query"
    scaled_weights = ("kv_b",)
    inputs = 2
    attrs = _rope_attrs()
    weights = {"kv_b": True}
    doc = "[q_nope [T, H, N], q_pe [T, H, R]] -> q [T, H, C+R] = [q_nope @ W_UK | rope(q_pe)]"

    @classmethod
    def infer(cls, node, ins, model):
        qn, qp = ins
        d = model.dims
        H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
        expect(qn.shape[1:] == (H, d["qk_nope_head_dim"]), f"mla_decode_query expects q_nope [T, H, N], got {qn}")
        expect(qp.shape[1:] == (H, R), f"mla_decode_query expects q_pe [T, H, R], got {qp}")
        return [TType((qn.shape[0], H, C + R), "act")], {"kv_b": _kv_b_shape(model)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        w_uk, _ = split_kv_b(w["kv_b"], node.model)
        q_lat = torch.einsum("thn,hnc->thc", ins[0], w_uk)
        return [torch.cat([q_lat, _rotate(node, ins[1], ctx, node.model)], dim=-1)]


@register
class MlaDecodePrologue(OpDef):
    name = "mla_decode_prologue"
    scaled_weights = ("kv_b",)
    inputs = 4
    outputs = 4
    attrs = {"eps": Attr("float", None, positive=True), **_rope_attrs()}
    weights = {"kv_b": True, "norm": True}
    doc = ("[q_nope [T, H, N], q_pe [T, H, R], c [T, C], k_pe [T, R]] -> [q [T, H, C+R], c_n, k_rot, state]: "
           "mla_decode_query and mla_kv_cache_write side by side (they read the same projection, not each other)")

    @classmethod
    def infer(cls, node, ins, model):
        (q,), w_q = MlaDecodeQuery.infer(node, ins[:2], model)
        outs, w_kv = MlaKvCacheWrite.infer(node, ins[2:], model)
        return [q, *outs], {**w_q, **w_kv}

    @classmethod
    def run(cls, node, ins, w, ctx):
        return [*MlaDecodeQuery.run(node, ins[:2], w, ctx), *MlaKvCacheWrite.run(node, ins[2:], w, ctx)]


@register
class MlaDecodeAttention(OpDef):
    name = "mla_decode_attention"
    inputs = 3
    doc = "[q_lat [T, H, C], q_rot [T, H, R], state] -> o_lat [T, H, C]: attends over compressed cache rows"

    @classmethod
    def infer(cls, node, ins, model):
        ql, qr, st = ins
        d = model.dims
        H, C, R = d["heads"], d["kv_lora_rank"], d["qk_rope_head_dim"]
        expect(ql.shape[1:] == (H, C), f"mla_decode_attention expects q_lat [T, {H}, {C}], got {ql}")
        expect(qr.shape[1:] == (H, R), f"mla_decode_attention expects q_rot [T, {H}, {R}], got {qr}")
        expect(st.dtype == "state", f"mla_decode_attention's third input must be the cache state, got {st}")
        return [TType((ql.shape[0], H, C), "act")], {}

    @classmethod
    def run(cls, node, ins, w, ctx):
        C = node.model.dims["kv_lora_rank"]
        q = torch.cat([ins[0], ins[1]], dim=-1)
        out = torch.empty(q.shape[0], q.shape[1], C, dtype=torch.float64, device=q.device)
        for b, (s, e) in enumerate(ctx.query_ranges()):
            rows = ctx.gather_rows(node.layer, b).to(q.device)
            out[s:e] = _attend(q[s:e], rows, rows[:, :C], ctx.positions[s:e], node.model.softmax_scale)
        return [out.to(ins[0].dtype)]


@register
class MlaVUp(OpDef):
    name = "mla_v_up"
    scaled_weights = ("kv_b",)
    weights = {"kv_b": True}
    doc = "o_lat [T, H, C] -> o [T, H*V] = o_lat @ W_UV^T (the V half of kv_b, applied after attention)"
    # attrs["quant"] = "fp8" (ir/passes/fuse_v_up_fp8_quant.py; never a spec): o's e4m3 rows and per-128-column
    # scales as two more outputs, as a norm's (ir/ops/core.py norm_quant_types): quantize_act_fp8(o).

    @classmethod
    def infer(cls, node, ins, model):
        (ol,) = ins
        d = model.dims
        expect(ol.shape[1:] == (d["heads"], d["kv_lora_rank"]), f"mla_v_up expects [T, H, C], got {ol}")
        expect(node.attrs.get("quant") in (None, "fp8"), f"mla_v_up writes fp8 rows or none, not "
                                                         f"{node.attrs.get('quant')!r}")
        o = TType((ol.shape[0], d["heads"] * d["v_head_dim"]), "act")
        return [o, *norm_quant_types(node, o)], {"kv_b": _kv_b_shape(model)}

    @classmethod
    def run(cls, node, ins, w, ctx):
        _, w_uv = split_kv_b(w["kv_b"], node.model)
        o = torch.einsum("thc,hvc->thv", ins[0], w_uv)
        o = o.reshape(o.shape[0], -1)
        return [o, *norm_quant_ref(node, o)]
