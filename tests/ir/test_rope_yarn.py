"""ir/rope.py and ModelConfig.softmax_scale against transformers' own YaRN code.

The spec side goes through ``spec_from_config`` (the path every checkpoint takes), so a
rope key the translation drops or misreads fails here, not only in an e2e run.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV2Config, DeepseekV3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention  # noqa: E402

from ir import load_spec, rope  # noqa: E402
from ir.config_to_spec import spec_from_config  # noqa: E402
from ir.model import RopeConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["deepseek_v2_lite", "deepseek_v2", "deepseek_v3"]


def _hf_config(model_type: str, rope_parameters: dict, *, rope_dim=8, max_pos=256, **kw):
    cls = DeepseekV3Config if model_type == "deepseek_v3" else DeepseekV2Config
    dims = dict(hidden_size=42, num_attention_heads=3, kv_lora_rank=20, q_lora_rank=None, qk_rope_head_dim=rope_dim,
                qk_nope_head_dim=10, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                max_position_embeddings=max_pos, vocab_size=97, num_hidden_layers=2)
    dims.update(kw)
    return cls(**dims, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, **rope_parameters})


def _shipped_hf_config(name: str):
    raw = json.loads((ROOT / "model_specs" / "hf_configs" / f"{name}.json").read_text())
    cls = DeepseekV3Config if raw["model_type"] == "deepseek_v3" else DeepseekV2Config
    keep = {k: v for k, v in raw.items() if not k.startswith("_") and k not in ("architectures", "auto_map")}
    return cls(**keep)


def _scaling(hf_config) -> float:
    cls = DeepseekV3Attention if hf_config.model_type == "deepseek_v3" else DeepseekV2Attention
    with torch.device("meta"):          # full-size projections, no memory
        return cls(hf_config, layer_idx=0).scaling


def _ours(hf_config):
    return load_spec(spec_from_config(hf_config.to_dict()), file="from_config.yaml").model


CASES = {
    "tiny mscale<mscale_all_dim": ("deepseek_v2", dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0,
                                                        mscale_all_dim=0.707)),
    "tiny equal mscales": ("deepseek_v2", dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707,
                                               mscale_all_dim=0.707)),
    "mscale_all_dim only": ("deepseek_v2", dict(factor=4.0, original_max_position_embeddings=64, mscale_all_dim=0.707)),
    "mscale only": ("deepseek_v2", dict(factor=4.0, original_max_position_embeddings=64, mscale=0.707)),
    "no mscales": ("deepseek_v3", dict(factor=4.0, original_max_position_embeddings=64)),
    "no truncation": ("deepseek_v3", dict(factor=4.0, original_max_position_embeddings=64, mscale=0.8,
                                          mscale_all_dim=0.6, truncate=False)),
    "betas": ("deepseek_v3", dict(factor=8.0, original_max_position_embeddings=32, beta_fast=16.0, beta_slow=2.0,
                                  mscale=1.0, mscale_all_dim=1.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_tables_match_transformers(case):
    model_type, params = CASES[case]
    rope_dim = 12 if case == "betas" else 8
    hf = _hf_config(model_type, params, rope_dim=rope_dim)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = _ours(hf)
    torch.testing.assert_close(rope.inv_freq(ours.rope, rope_dim), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope.attention_factor(ours.rope) == pytest.approx(attention_factor, rel=1e-12)
    assert ours.softmax_scale == pytest.approx(_scaling(hf), rel=1e-12)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_match_transformers(name):
    hf = _shipped_hf_config(name)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    spec = load_spec(str(ROOT / "model_specs" / f"{name}.yaml"))
    R = spec.dims["qk_rope_head_dim"]
    torch.testing.assert_close(rope.inv_freq(spec.model.rope, R), inv_freq.float(), rtol=1e-6, atol=0)
    assert rope.attention_factor(spec.model.rope) == pytest.approx(attention_factor, rel=1e-12)
    assert spec.model.softmax_scale == pytest.approx(_scaling(hf), rel=1e-12)


def test_v2_lite_softmax_scale():
    spec = load_spec(str(ROOT / "model_specs" / "deepseek_v2_lite.yaml"))
    mscale = 0.1 * 0.707 * math.log(40) + 1
    assert spec.model.softmax_scale == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-12)
    assert spec.model.softmax_scale == pytest.approx(0.1147, abs=1e-4)


def test_without_scaling_the_tables_are_plain_rope():
    plain = RopeConfig(theta=10000.0)
    want = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
    torch.testing.assert_close(rope.inv_freq(plain, 8), want)
    assert rope.attention_factor(plain) == 1.0


def _hf_rotate_v2(x, cos_sin_positions, hf):
    """transformers' DeepseekV2 rotation (complex multiply of adjacent pairs)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RotaryEmbedding, apply_rotary_emb
    emb = DeepseekV2RotaryEmbedding(hf)
    freqs_cis = emb(x, cos_sin_positions[None])             # [1, T, R/2] complex
    q, k = apply_rotary_emb(x[None].transpose(1, 2), x[None, :, :1].transpose(1, 2), freqs_cis)
    return q.transpose(1, 2)[0]


def test_rotation_layouts_match_transformers():
    """DeepseekV2: adjacent pairs written back interleaved; DeepseekV3: adjacent pairs in, halves out."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                      apply_rotary_pos_emb_interleave)
    params = dict(factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707)
    positions = torch.tensor([0, 1, 5, 63, 64, 200])
    x = torch.randn(len(positions), 3, 8, generator=torch.Generator().manual_seed(0))   # [T, H, R]

    hf2 = _hf_config("deepseek_v2", params)
    ours2 = _ours(hf2)
    cos, sin = rope.cos_sin(ours2.rope, 8, positions)
    torch.testing.assert_close(rope.rotate(x, cos, sin, "adjacent", "interleaved"), _hf_rotate_v2(x, positions, hf2),
                               rtol=1e-5, atol=1e-6)

    hf3 = _hf_config("deepseek_v3", params)
    ours3 = _ours(hf3)
    cos3, sin3 = DeepseekV3RotaryEmbedding(hf3)(x, positions[None])
    q, _ = apply_rotary_pos_emb_interleave(x[None].transpose(1, 2), x[None].transpose(1, 2), cos3, sin3)
    cos, sin = rope.cos_sin(ours3.rope, 8, positions)
    torch.testing.assert_close(rope.rotate(x, cos, sin, "adjacent", "halves"), q.transpose(1, 2)[0],
                               rtol=1e-5, atol=1e-6)


# -- the tables codegen bakes in are computed without torch ---------------------------------------

def _ulps(a: float, b: float) -> int:
    import struct
    ia, ib = (struct.unpack("<i", struct.pack("<f", v))[0] for v in (a, b))
    return abs(ia - ib)


@pytest.mark.parametrize("name", SHIPPED + ["deepseek_tiny"])
def test_shipped_tables_equal_transformers_bit_for_bit(name):
    """So the committed goldens (which print these constants) do not depend on the torch build."""
    hf = _shipped_hf_config(name)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf)
    spec = load_spec(str(ROOT / "model_specs" / f"{name}.yaml"))
    assert rope.inv_freq_values(spec.model.rope, spec.dims["qk_rope_head_dim"]) == tuple(inv_freq.float().tolist())


@pytest.mark.parametrize("theta", [10000.0, 50000.0, 1e6])
@pytest.mark.parametrize("rope_dim", [8, 16, 64, 128])
@pytest.mark.parametrize("params", [dict(factor=40.0, original_max_position_embeddings=4096),
                                    dict(factor=4.0, original_max_position_embeddings=64, truncate=False),
                                    dict(factor=8.0, original_max_position_embeddings=512, beta_fast=16.0,
                                         beta_slow=2.0)])
def test_tables_within_two_float32_ulps_of_transformers(theta, rope_dim, params):
    """torch's vectorised float32 pow is not always correctly rounded; Python's is."""
    max_pos = int(params["factor"] * params["original_max_position_embeddings"])   # transformers derives the factor
    hf = _hf_config("deepseek_v3", {**params, "rope_theta": theta}, rope_dim=rope_dim, max_pos=max_pos)
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](hf)
    ours = rope.inv_freq_values(_ours(hf).rope, rope_dim)
    assert max(_ulps(a, b) for a, b in zip(ours, inv_freq.float().tolist())) <= 2
    plain = RopeConfig(theta=theta)
    want = (1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)).tolist()
    assert max(_ulps(a, b) for a, b in zip(rope.inv_freq_values(plain, rope_dim), want)) <= 1
