"""ir/parallel.py: which weight each rank holds, and which rank counts a model refuses."""
import pytest

import ir
from codegen.paths import MODEL_SPECS_DIR
from ir.parallel import ParallelError, REPLICATED, Shard, check_parallel, parallel_problems, sharded_shape, weight_shard


def spec(name):
    return ir.load_spec(str(MODEL_SPECS_DIR / f"{name}.yaml"))


def test_rank_counts_that_do_not_divide_are_refused_with_every_reason():
    lite = spec("deepseek_v2_lite")
    assert parallel_problems(lite, 1) == parallel_problems(lite, 8) == []
    with pytest.raises(ParallelError, match=r"cannot run on 3 ranks: heads .* = 16 does not divide by 3 ranks; "
                                            r"routed experts .* = 64 does not divide by 3"):
        check_parallel(lite, 3)
    with pytest.raises(ParallelError, match="whole number"):
        check_parallel(lite, 0)


def test_the_split_weights_and_the_replicated_ones():
    m = spec("deepseek_v2").model          # H 128, N 128, R 64, V 128, Q 1536, C 512, D 5120
    L = "model.layers.7."
    q_b = weight_shard(L + "self_attn.q_b_proj.weight", (128 * 192, 1536), m, 4, 2)
    assert q_b == Shard("rows", 2 * 32 * 192, 3 * 32 * 192) and q_b.dim == 0
    assert weight_shard(L + "self_attn.kv_b_proj.weight", (128 * 256, 512), m, 4, 3) == Shard("rows", 3 * 8192, 4 * 8192)
    o = weight_shard(L + "self_attn.o_proj.weight", (5120, 128 * 128), m, 4, 1)
    assert o == Shard("cols", 4096, 8192) and sharded_shape((5120, 16384), o) == (5120, 4096)
    for name in ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.q_a_proj.weight", "self_attn.kv_a_layernorm.weight",
                 "mlp.gate.weight", "input_layernorm.weight"):
        assert weight_shard(L + name, (576, 5120), m, 4, 0) == REPLICATED
    assert weight_shard("lm_head.weight", (102400, 5120), m, 4, 0) == REPLICATED
    ex = weight_shard(L + "mlp.experts.*.gate_proj.weight", (160, 1536, 5120), m, 8, 5)
    assert ex == Shard("experts", 100, 120) and sharded_shape((160, 1536, 5120), ex) == (20, 1536, 5120)
    sh = weight_shard(L + "mlp.shared_experts.down_proj.weight", (5120, 2 * 1536), m, 2, 1)
    assert sh == Shard("cols", 1536, 3072)
    assert weight_shard(L + "self_attn.o_proj.weight", (5120, 16384), m, 1, 0) == REPLICATED
