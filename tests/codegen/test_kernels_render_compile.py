"""Property: for random valid tiny models, every kernel the compiler generates renders
byte-identically twice and compiles with NVRTC (no GPU needed)."""
from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from codegen.bundle import compile_kernels, plan_spec, unique_kernels
from codegen.kernel import Options
from tiny import tiny_config

import ir
from ir.config_to_spec import spec_from_config

_COMPILED: set[str] = set()   # source digests already compiled (many examples share kernels)


@st.composite
def configs(draw):
    v3 = draw(st.booleans())
    experts = draw(st.sampled_from([4, 8, 16]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if experts % g == 0 and (not v3 or experts // g >= 2)]))
    topk_groups = draw(st.integers(1, groups))
    per_group = experts // groups
    top_k = draw(st.integers(1, min(4, topk_groups * per_group)))
    overrides = dict(
        model_type="deepseek_v3" if v3 else "deepseek_v2",
        hidden_size=draw(st.sampled_from([64, 128, 256])),
        num_attention_heads=draw(st.sampled_from([1, 2, 4, 8])),
        q_lora_rank=draw(st.sampled_from([None, 32, 64])),
        kv_lora_rank=draw(st.sampled_from([32, 64, 128, 512])),
        qk_rope_head_dim=draw(st.sampled_from([16, 32, 64])),
        qk_nope_head_dim=draw(st.sampled_from([16, 32, 64, 128])),
        v_head_dim=draw(st.sampled_from([16, 32, 128])),
        moe_intermediate_size=draw(st.sampled_from([32, 64])),
        n_routed_experts=experts, n_group=groups, topk_group=topk_groups, num_experts_per_tok=top_k,
        n_shared_experts=draw(st.sampled_from([1, 2])),
    )
    if not v3:
        overrides["topk_method"] = "greedy" if groups == 1 else draw(
            st.sampled_from(["greedy", "group_limited_greedy"]))
    return tiny_config(**overrides)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), dtype=st.sampled_from(["bf16", "fp16", "fp32"]),
       block_size=st.sampled_from([16, 32, 64, 128]))
def test_kernels_render_deterministically_and_compile(cfg, dtype, block_size):
    spec = ir.load_spec(spec_from_config(cfg, name="prop"), file="prop.yaml")
    opts = Options(dtype=dtype, block_size=block_size)
    first = unique_kernels(plan_spec(spec, opts, strict=False).plans)
    second = unique_kernels(plan_spec(spec, opts, strict=False).plans)
    assert [(k.name, k.source) for k in first] == [(k.name, k.source) for k in second]
    assert len({k.name for k in first}) == len(first)
    todo = [k for k in first if hashlib.sha256(k.source.encode()).hexdigest() not in _COMPILED]
    cubins = compile_kernels(todo, "sm_90", jobs=2)
    for k in todo:
        assert cubins[k.name][:4] == b"\x7fELF", k.name
        _COMPILED.add(hashlib.sha256(k.source.encode()).hexdigest())
