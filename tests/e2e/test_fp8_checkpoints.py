"""DeepSeek-V3's FP8 checkpoints run as stored (issue 49 items 1, 2, 4 on the CPU).

Tiny V3- and V2-Lite-style models saved with transformers (fp32), written in V3's FP8 layout by our
`dsgraph quantize` (widths past one 128-block and not multiples of it, so every edge block is a partial
"ceil block", as kv_a_proj_with_mqa's 576 rows are in V3; a 16-expert, 4-group noaux router), loaded by
`Engine.from_pretrained(..., backend="reference")` with the spec `--from-config` writes (its weights FP8 as
stored), and compared with transformers run on the dequantised weights: a dequantised copy of the
checkpoint loaded by transformers' own from_pretrained.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

import hf_tiny  # noqa: E402  (tests/e2e is on sys.path)
from ir.formats import FP8, dequantize, quantize, scale_shape  # noqa: E402
from runtime import Engine  # noqa: E402
from runtime.cli import main as cli_main  # noqa: E402
from runtime.convert import Converted  # noqa: E402
from runtime.errors import WeightError  # noqa: E402
from runtime.quantize import V3_QUANTIZATION_CONFIG  # noqa: E402
from runtime.weights import Checkpoint  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-5)
KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"


def _v3_fp8_config():
    """V3-style with odd widths past one block: hidden 137, kv_a rows 151 + 8 = 159 (a 31-row ceil block, as
    576 = 4 x 128 + 64 is in V3), 16 experts in 4 groups (noaux_tc, top-3 of 2 groups), moe_intermediate 141."""
    from transformers import DeepseekV3Config
    return DeepseekV3Config(**hf_tiny._common(
        hidden_size=137, intermediate_size=261, moe_intermediate_size=141, kv_lora_rank=151, q_lora_rank=131,
        num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_interleave=True, initializer_range=0.05, rope_parameters=hf_tiny._yarn(4.0, 64, 1.0, 1.0)))


def _v2_lite_fp8_config():
    """V2-Lite-style (q projected directly, softmax greedy, two shared experts) with odd widths past one block
    (kv_lora_rank stays even: transformers V2 views rope pairs as complex numbers)."""
    from transformers import DeepseekV2Config
    return DeepseekV2Config(**hf_tiny._common(
        hidden_size=135, intermediate_size=201, moe_intermediate_size=131, kv_lora_rank=140, q_lora_rank=None,
        num_hidden_layers=2, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0,
        initializer_range=0.05, rope_parameters=hf_tiny._yarn(4.0, 64, 0.707, 0.707)))


CONFIGS = {"v3": _v3_fp8_config, "v2_lite": _v2_lite_fp8_config}


def _save_fp32(make, out, seed=0):
    config = make()
    torch.manual_seed(seed)
    model = hf_tiny._model_class(config)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(torch.randn(gate.e_score_correction_bias.shape, generator=gen) * 0.3)
    model.save_pretrained(out)
    return out


def _dequantised_copy(fp8_dir, out):
    """fp8_dir with every FP8 weight dequantised (float32) and no quantization_config: what transformers runs."""
    view = Converted(Checkpoint.open(fp8_dir), "dtype")
    out.mkdir()
    save_file({n: view.get(n).contiguous() for n in sorted(view.names())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def fp8_model(request, tmp_path_factory):
    """(name, fp32 dir, fp8 dir, transformers on the dequantised weights)."""
    name = request.param
    root = tmp_path_factory.mktemp(f"fp8_{name}")
    src = _save_fp32(CONFIGS[name], root / "fp32")
    fp8 = root / "fp8"
    assert cli_main(["quantize", "--to", "fp8", str(src), str(fp8)]) == 0
    hf = hf_tiny.load_reference(_dequantised_copy(fp8, root / "dequantised"))
    return name, src, fp8, hf


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, hf_tiny.VOCAB, (n,), generator=g).tolist() for n in (1, 5, 9)]


def test_fp8_checkpoint_runs_as_stored_and_matches_transformers_on_the_dequantised_weights(fp8_model):
    name, _, fp8, hf = fp8_model
    engine = Engine.from_pretrained(fp8, backend="reference", device="cpu", dtype=torch.float32,
                                    block_size=hf_tiny.BLOCK_SIZE)
    fp8_weights = {n for n, s in engine.weight_specs.items() if s.format == FP8.name}
    assert any("experts.*" in n for n in fp8_weights) and any("self_attn" in n for n in fp8_weights)
    held = engine.backend.weights
    assert all(held[n].dtype == torch.float8_e4m3fn for n in fp8_weights)
    assert held["model.embed_tokens.weight"].dtype == torch.float32 and held["lm_head.weight"].dtype == torch.float32
    if name == "v3":
        assert held[KV_A + "_scale_inv"].shape == (2, 2)     # 159 x 137: ceil blocks in both dims
        assert held["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    prompts = _prompts()
    for prompt, ours in zip(prompts, engine.logits(prompts)):
        torch.testing.assert_close(ours, hf_tiny.hf_logits(hf, prompt), **TOL)


def test_online_quantisation_is_the_offline_one(fp8_model):
    """from_pretrained(bf16/fp32 dir, weight_format="fp8") holds the very bytes `dsgraph quantize` writes."""
    _, src, fp8, _ = fp8_model
    online = Engine.from_pretrained(src, backend="reference", device="cpu", dtype=torch.float32, weight_format="fp8")
    offline = Engine.from_pretrained(fp8, backend="reference", device="cpu", dtype=torch.float32)
    assert online.weight_specs == offline.weight_specs
    for n, t in offline.backend.weights.items():
        a, b = online.backend.weights[n], t
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                                  b.view(torch.uint8) if b.element_size() == 1 else b), n


def test_quantize_writes_v3s_layout_by_the_rule(fp8_model):
    _, src, fp8, _ = fp8_model
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == V3_QUANTIZATION_CONFIG
    assert {k: v for k, v in config.items() if k != "quantization_config"} == json.loads((src / "config.json").read_text())
    before, after = load_file(str(src / "model.safetensors")), load_file(str(fp8 / "model.safetensors"))
    fp8_names = {n for n, t in after.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_names and set(after) == set(before) | {n + "_scale_inv" for n in fp8_names}
    for n in fp8_names:
        w = before[n]
        scale = after[n + "_scale_inv"]
        assert scale.dtype == torch.float32 and tuple(scale.shape) == scale_shape(tuple(w.shape), FP8)
        # the rule, block by block: s = amax / 448 (1 for an all-zero block), q = RNE(W / s) saturated
        for bi in range(scale.shape[0]):
            for bj in range(scale.shape[1]):
                block = w[bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128].float()
                amax = block.abs().max()
                s = amax / 448 if amax > 0 else torch.tensor(1.0)
                assert scale[bi, bj] == s
                q = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
                got = after[n][bi * 128:(bi + 1) * 128, bj * 128:(bj + 1) * 128]
                assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)), (n, bi, bj)
    for n in set(before) - fp8_names:
        assert torch.equal(after[n], before[n]), n
    kept = set(before) - fp8_names
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.1.input_layernorm.weight", "model.layers.1.mlp.gate.weight"} <= kept
    for n in kept:
        assert "_proj" not in n, f"{n} should be FP8 in V3's layout"
    for n in fp8_names:
        assert n.endswith("_proj.weight") or n.endswith("kv_a_proj_with_mqa.weight"), n


def test_quantize_rule_edges():
    w = torch.zeros(130, 3)
    w[129, 2] = 1e6                        # far past 448 at s = 1: the block's own scale brings it to 448
    q, (s,) = quantize(w, FP8)
    big = torch.tensor(1e6) / 448          # in float32, as the rule computes it
    assert torch.equal(s, torch.stack([torch.tensor([1.0]), big.reshape(1)]))
    assert q[129, 2].float() == 448 and q[:128].float().abs().sum() == 0
    assert dequantize(q, (s,), FP8)[129, 2] == big * 448


@pytest.mark.parametrize("case", ["fp8_where_bf16", "bf16_where_fp8", "scale_missing", "scale_misshaped"])
def test_a_checkpoint_in_another_format_is_one_weight_error_naming_the_tensor(fp8_model, tmp_path, case):
    name, src, fp8, _ = fp8_model
    if name != "v3":
        pytest.skip("one model is enough")
    bad = tmp_path / "bad"
    shutil.copytree(fp8, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    config = json.loads((bad / "config.json").read_text())
    if case == "fp8_where_bf16":       # the config says nothing of FP8: the spec expects the model dtype
        del config["quantization_config"]
        want = f"{KV_A}: the checkpoint stores it as F8_E4M3"
    elif case == "bf16_where_fp8":
        tensors[KV_A] = dequantize(tensors[KV_A], (tensors[KV_A + "_scale_inv"],), FP8).to(torch.bfloat16)
        want = f"{KV_A}: the spec stores it as fp8_e4m3_block128 (F8_E4M3), the checkpoint has BF16"
    elif case == "scale_missing":
        del tensors[KV_A + "_scale_inv"]
        want = f"{KV_A}_scale_inv (expected shape (2, 2))"
    else:
        tensors[KV_A + "_scale_inv"] = torch.ones(1, 2)
        want = f"{KV_A}_scale_inv: checkpoint has shape (1, 2), the spec expects (2, 2)"
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightError) as info:
        Engine.from_pretrained(bad, backend="reference", device="cpu", dtype=torch.float32)
    message = str(info.value)
    assert want in message and message.count(KV_A) == 1, message


def test_dequantising_on_request_runs_what_fp8_runs(fp8_model):
    """weight_format="dtype": an FP8 checkpoint's weights widened at load (for a backend without FP8 kernels)
    give the logits the FP8 weights give."""
    _, _, fp8, _ = fp8_model
    kw = dict(backend="reference", device="cpu", dtype=torch.float32)
    wide = Engine.from_pretrained(fp8, weight_format="dtype", **kw)
    assert not any(s.format for s in wide.weight_specs.values())
    assert not any(n.endswith("_scale_inv") for n in wide.weight_specs)
    stored = Engine.from_pretrained(fp8, **kw)
    prompts = _prompts()
    for a, b in zip(wide.logits(prompts), stored.logits(prompts)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_weight_format_and_quantize_mistakes_are_one_line(fp8_model, tmp_path, capsys):
    from runtime.errors import InputError
    _, src, fp8, _ = fp8_model
    with pytest.raises(InputError, match="weight_format must be None, 'fp8' or 'dtype', got 'int4'"):
        Engine.from_pretrained(src, backend="reference", device="cpu", weight_format="int4")
    assert cli_main(["quantize", "--to", "fp8", str(fp8), str(tmp_path / "again")]) == 2
    assert "has a quantization_config already" in capsys.readouterr().err
    assert cli_main(["quantize", "--to", "fp8", str(src), str(fp8)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err


def test_generate_converts_a_checkpoint_as_it_loads_with_weight_format(fp8_model, capsys):
    """`generate --weight-format fp8` on the fp32 checkpoint gives the tokens of the checkpoint `dsgraph
    quantize` wrote (the same bytes: test_online_quantisation_is_the_offline_one); with --random-weights the
    option is one line."""
    _, src, fp8, _ = fp8_model
    run = ["--ids", "1,2,3", "--max-new-tokens", "4", "--device", "cpu"]

    def ids(argv):
        assert cli_main(["generate", *argv, *run]) == 0
        return [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ids:")]

    online = ids(["--model", str(src), "--weight-format", "fp8"])
    assert online and online == ids(["--model", str(fp8)])
    assert cli_main(["generate", "--random-weights", "--weight-format", "fp8", *run]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--weight-format converts a checkpoint's weights" in err
