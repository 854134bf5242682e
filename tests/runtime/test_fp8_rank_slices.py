"""A rank of a tensor / expert parallel run reads its slice of an FP8 checkpoint as stored: the weight's
rows or columns on 128-blocks and its scales' blocks with them (the manifest's part / stored), its experts
and their scales; the bytes are the whole tensors' own."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

import ir
from ir.config_to_spec import spec_from_config
from runtime.model_loader import checkpoint_tensors, compile_graphs, random_weights, weight_specs
from runtime.weights import Checkpoint, load_weights

CFG = {  # every split dim a whole number of 128-blocks a rank: 16 heads x (16 + 16), V 16, widths 256
    "model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 16, "q_lora_rank": 40,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "intermediate_size": 256,
    "moe_intermediate_size": 256, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "n_group": 2, "topk_group": 1, "vocab_size": 50, "num_hidden_layers": 2, "first_k_dense_replace": 1,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_its_fp8_blocks_and_scales_as_stored(tmp_path, rank):
    spec = ir.load_spec(spec_from_config(CFG, name="t"), file="t.yaml")
    whole_specs = weight_specs(compile_graphs(spec, passes=False).graphs)
    tensors = checkpoint_tensors(whole_specs, random_weights(whole_specs, dtype=torch.float32, device="cpu", seed=1))
    assert any(t.dtype == torch.float8_e4m3fn for t in tensors.values())
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    specs = weight_specs(compile_graphs(spec, world=2, rank=rank).graphs)
    ckpt = Checkpoint.open(tmp_path)
    got = load_weights(ckpt, specs, dtype=torch.float32, device="cpu")
    q_b = "model.layers.0.self_attn.q_b_proj.weight"         # 512 rows: a rank holds 256 (2 blocks)
    assert specs[q_b].part == (0, 256 * rank, 256 * (rank + 1))
    assert specs[q_b + "_scale_inv"].part == (0, 2 * rank, 2 * (rank + 1))
    o = "model.layers.0.self_attn.o_proj.weight"             # 256 columns: a rank holds 128 (1 block)
    assert specs[o + "_scale_inv"].part == (1, rank, rank + 1)
    for name, spec in specs.items():
        if spec.part is not None:
            dim, start, stop = spec.part
            want = tensors[name].narrow(dim, start, stop - start)
            assert torch.equal(_bytes(got[name]), _bytes(want)), name
        elif spec.parts is not None and all(isinstance(p, str) for p in spec.parts):
            assert torch.equal(_bytes(got[name]), _bytes(torch.stack([tensors[p] for p in spec.parts]))), name
    experts = "model.layers.1.mlp.experts.*.up_proj.weight"
    assert specs[experts + "_scale_inv"].parts == tuple(f"model.layers.1.mlp.experts.{e}.up_proj.weight_scale_inv"
                                                        for e in (2 * rank, 2 * rank + 1))
    assert got[experts].dtype == torch.float8_e4m3fn and got[experts + "_scale_inv"].dtype == torch.float32
    # a rank touches only its slices and its experts: never another rank's scales
    others = {f"model.layers.1.mlp.experts.{e}.up_proj.weight_scale_inv" for e in range(4)} - set(
        specs[experts + "_scale_inv"].parts)
    assert not others & {n for n, _ in ckpt.reads}
