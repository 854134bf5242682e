"""msModelSlim W8A8 / W4A8 checkpoints run on the reference backend with their exact integer arithmetic
(issue 50 item 4, CPU), checked against an independent implementation written here from the seed's modeling
code (DeepseekV3 of transformers, as modeling_deepseek.py) with vllm-ascend's quantised linears swapped in:
per-token symmetric int8 activations (torch_npu.npu_dynamic_quant), an exact integer product, then the
weight's and the token's scales; the routed experts' down projection re-quantises its input per row.
Nothing of dsgraph's quantisation code is used on this side (the nibbles are unpacked here too).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from torch import nn

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/e2e is on sys.path)
from runtime import Engine  # noqa: E402
from runtime.msmodelslim import DESCRIPTION_FILE, INDEX_FILE  # noqa: E402
from runtime.quantize import quantize_checkpoint  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [40, 41, 42, 43]]


def _tensors(ckpt_dir):
    index = json.loads((ckpt_dir / INDEX_FILE).read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(str(ckpt_dir / file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _act_quant(x):
    """npu_dynamic_quant: scale = rowmax|x| / 127, y = round(x / scale) (half to even), int8."""
    s = x.abs().amax(-1, keepdim=True) / 127.0
    return torch.round(x / torch.where(s > 0, s, torch.ones_like(s))).clamp(-128, 127), s


def _int4_rows(packed):
    """int8 [O/2, I] -> [O, I]: byte j holds row 2j in its low nibble, row 2j+1 in its high one."""
    b = packed.to(torch.int32) & 0xFF
    lo, hi = b & 0xF, (b >> 4) & 0xF
    lo, hi = lo - 16 * (lo >= 8), hi - 16 * (hi >= 8)
    out = torch.empty(2 * b.shape[0], b.shape[1], dtype=torch.int32)
    out[0::2], out[1::2] = lo, hi
    return out


class QLinear(nn.Module):
    """vllm-ascend's W8A8_DYNAMIC / W4A8_DYNAMIC linear: int weight q [O, I], float scale s [O, 1]."""

    def __init__(self, q, scale):
        super().__init__()
        self.q, self.scale = q.to(torch.int64), scale.float().reshape(1, -1)

    def forward(self, x):
        qx, sx = _act_quant(x.float())
        acc = qx.to(torch.int64) @ self.q.T
        return ((acc.float() * self.scale) * sx).to(x.dtype)


class QExperts(nn.Module):
    """transformers' eager experts loop with each expert's gate, up and down a QLinear."""

    def __init__(self, experts, act_fn):
        super().__init__()
        self.experts, self.act_fn = experts, act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e, (gate, up, down) in enumerate(self.experts):
            pos, tok = torch.where(top_k_index.T == e)
            if tok.numel() == 0:
                continue
            h = hidden_states[tok]
            y = down(self.act_fn(gate(h)) * up(h)) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def seed_model(float_dir, quant_dir, scale_error: float = 1.0):
    """The transformers model of `float_dir` with every linear msModelSlim quantised in `quant_dir` swapped
    for a QLinear of its stored integers and scales (`scale_error` multiplies one scale: a planted mutant)."""
    model = hf_tiny.load_reference(float_dir)
    t, desc = _tensors(quant_dir), json.loads((quant_dir / DESCRIPTION_FILE).read_text())

    def qlinear(prefix):
        w = t[prefix + ".weight"]
        kind = desc[prefix + ".weight"]
        q = _int4_rows(w) if kind == "W4A8_DYNAMIC" else w.to(torch.int32)
        return QLinear(q, t[prefix + ".weight_scale"])

    for name, module in list(model.named_modules()):
        for child, sub in list(module.named_children()):
            full = f"{name}.{child}" if name else child
            if isinstance(sub, nn.Linear) and desc.get(full + ".weight", "FLOAT") != "FLOAT":
                setattr(module, child, qlinear(full))
            elif type(sub).__name__.endswith("Experts"):
                experts = [tuple(qlinear(f"{full}.{e}.{r}_proj") for r in ("gate", "up", "down"))
                           for e in range(sub.num_experts)]
                setattr(module, child, QExperts(experts, sub.act_fn))
    first = model.model.layers[0].self_attn.o_proj     # (q_a_proj's would be normalised away by q_a_layernorm)
    first.scale = first.scale * scale_error
    return model


# V3-like (q_lora, noaux router, 2 dense layers, 1 shared expert) and V2-Lite-like (q_proj, greedy softmax
# routing, 2 shared experts) with even widths, so int4 packs two output channels a byte.
CASES = [("v3_tp", "w8a8"), ("v3_tp", "w4a8"), ("v2_lite_tp", "w4a8")]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(c) for c in CASES])
def quantised(request, tmp_path_factory):
    model, to = request.param
    root = tmp_path_factory.mktemp(f"{model}_{to}")
    src = hf_tiny.build(model, root / "float")
    quantize_checkpoint(src, root / "q", to)
    return src, root / "q"


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_the_reference_runs_the_quantised_arithmetic_of_the_seed_model(quantised):
    src, q = quantised
    engine = Engine.from_pretrained(str(q), backend="reference", device="cpu", dtype=torch.float32)
    ours = engine.logits(PROMPTS)
    seed, mutant = seed_model(src, q), seed_model(src, q, scale_error=1.01)
    floats = Engine.from_pretrained(str(src), backend="reference", device="cpu", dtype=torch.float32).logits(PROMPTS)
    for prompt, got, f in zip(PROMPTS, ours, floats):
        want, bad = hf_tiny.hf_logits(seed, prompt), hf_tiny.hf_logits(mutant, prompt)
        # The same arithmetic in another order: a near-boundary activation may round the other way in a
        # few places; 1% on one scale of one linear moves the logits far more.
        assert _rel(got, want) < 1e-5, (prompt, _rel(got, want))
        assert _rel(got, bad) > 10 * max(_rel(got, want), 1e-6), (prompt, _rel(got, bad))
        assert _rel(got, f) > 1e-3     # and it is not the float model's arithmetic


def test_weight_only_dequantisation_on_request(quantised):
    src, q = quantised
    deq = Engine.from_pretrained(str(q), backend="reference", device="cpu", dtype=torch.float32,
                                 weight_format="dtype").logits(PROMPTS[:1])[0]
    exact = Engine.from_pretrained(str(q), backend="reference", device="cpu",
                                   dtype=torch.float32).logits(PROMPTS[:1])[0]
    assert 1e-4 < _rel(exact, deq) < 5e-2   # only the activations' int8 rounding differs


def test_paged_decode_and_greedy_tokens_follow_the_seed_model(quantised):
    """The decode graph (absorbed MLA, fused expert FFN) with the same integer arithmetic: teacher-forced
    decode logits at every position, and greedy tokens the seed model's argmax along our trajectory."""
    src, q = quantised
    engine = Engine.from_pretrained(str(q), backend="reference", device="cpu", dtype=torch.float32)
    seed = seed_model(src, q)
    for prompt, got in zip(PROMPTS, engine.logits(PROMPTS, decode_after=1)):
        assert _rel(got, hf_tiny.hf_logits(seed, prompt)) < 1e-5
    from runtime import SamplingParams
    (out,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=6))
    want = hf_tiny.hf_logits(seed, PROMPTS[0] + out.token_ids)[len(PROMPTS[0]) - 1:-1]
    for tok, row in zip(out.token_ids, want):
        top2 = row.topk(2)
        assert tok == int(top2.indices[0]) or (tok == int(top2.indices[1])
                                               and float(top2.values[0] - top2.values[1]) < 1e-4)
