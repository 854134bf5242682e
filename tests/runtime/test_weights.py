"""Checkpoint reading and load_weights validation on tiny safetensors files."""
import json

import pytest
import torch
from safetensors.torch import save_file

from ir.ops import WeightSlice
from ir.formats import FP8, dequantize
from runtime.convert import Converted
from runtime.errors import DsgraphError, WeightError
from runtime.weights import (
    Checkpoint,
    WeightSpec,
    load_config,
    load_weights,
)


def _rand(*shape, dtype=torch.float32):
    return (torch.randn(*shape) + 0.5).to(dtype)  # random, never zeros


def _load(model_dir, specs, weight_format=None, **kw):
    kw.setdefault("dtype", torch.float32)
    kw.setdefault("device", "cpu")
    ckpt = Checkpoint.open(model_dir)
    return load_weights(ckpt if weight_format is None else Converted(ckpt, weight_format), specs, **kw)


@pytest.fixture
def single(tmp_path):
    tensors = {"a.weight": _rand(3, 4), "b.bias": _rand(5)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def test_single_file(single):
    model_dir, tensors = single
    ckpt = Checkpoint.open(model_dir)
    assert ckpt.names() == {"a.weight", "b.bias"}
    assert ckpt.shape("a.weight") == (3, 4)
    assert ckpt.dtype_str("a.weight") == "F32"
    out = _load(model_dir, {"a.weight": WeightSpec((3, 4)), "b.bias": WeightSpec((5,))})
    assert set(out) == {"a.weight", "b.bias"}
    assert torch.equal(out["a.weight"], tensors["a.weight"])
    assert torch.equal(out["b.bias"], tensors["b.bias"])


def test_sharded_with_index(tmp_path):
    a, b, c = _rand(2, 3), _rand(4), _rand(3, 3)
    save_file({"a": a, "b": b}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": c}, str(tmp_path / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
                            "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    out = _load(tmp_path, {"a": WeightSpec((2, 3)), "b": WeightSpec((4,)), "c": WeightSpec((3, 3))})
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b) and torch.equal(out["c"], c)


def test_loose_files_without_index(tmp_path):
    save_file({"a": _rand(2)}, str(tmp_path / "x.safetensors"))
    save_file({"b": _rand(3)}, str(tmp_path / "y.safetensors"))
    assert Checkpoint.open(tmp_path).names() == {"a", "b"}


def test_index_naming_missing_shard(tmp_path):
    save_file({"a": _rand(2)}, str(tmp_path / "s1.safetensors"))
    index = {"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightError, match="s2.safetensors"):
        Checkpoint.open(tmp_path)


def test_bad_model_dirs(tmp_path):
    with pytest.raises(WeightError, match="does not exist"):
        Checkpoint.open(tmp_path / "nope")
    with pytest.raises(WeightError, match="no safetensors"):
        Checkpoint.open(tmp_path)
    assert issubclass(WeightError, DsgraphError)


def test_load_config(tmp_path):
    with pytest.raises(WeightError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(WeightError, match="config.json"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 24}')
    assert load_config(tmp_path) == {"hidden_size": 24}


def test_expert_stacking(tmp_path):
    experts = {f"mlp.experts.{e}.gate_proj.weight": _rand(6, 4) for e in range(3)}
    save_file(experts, str(tmp_path / "model.safetensors"))
    spec = WeightSpec((3, 6, 4), parts=tuple(f"mlp.experts.{e}.gate_proj.weight" for e in range(3)))
    out = _load(tmp_path, {"mlp.experts.gate_proj": spec}, dtype=torch.bfloat16)
    stacked = out["mlp.experts.gate_proj"]
    assert stacked.shape == (3, 6, 4) and stacked.dtype == torch.bfloat16
    for e in range(3):
        assert torch.equal(stacked[e], experts[f"mlp.experts.{e}.gate_proj.weight"].to(torch.bfloat16))


def test_stacked_spec_shape_must_match_parts():
    with pytest.raises(ValueError, match="shape\\[0\\]"):
        WeightSpec((2, 4), parts=("a", "b", "c"))


def test_dtype_cast_and_keep_fp32(tmp_path):
    w, router = _rand(4, 4, dtype=torch.bfloat16), _rand(2, 4, dtype=torch.bfloat16)
    save_file({"w": w, "gate.weight": router}, str(tmp_path / "model.safetensors"))
    specs = {"w": WeightSpec((4, 4)), "gate.weight": WeightSpec((2, 4), keep_fp32=True)}
    out = _load(tmp_path, specs, dtype=torch.float16)
    assert out["w"].dtype == torch.float16
    assert torch.equal(out["w"], w.to(torch.float16))
    assert out["gate.weight"].dtype == torch.float32
    assert torch.equal(out["gate.weight"], router.float())


def test_missing_tensor_names_it_and_its_shape(single):
    model_dir, _ = single
    specs = {"a.weight": WeightSpec((3, 4)), "b.bias": WeightSpec((5,)), "c.weight": WeightSpec((7, 2))}
    with pytest.raises(WeightError, match=r"c\.weight \(expected shape \(7, 2\)\)"):
        _load(model_dir, specs)


def test_many_missing_are_summarised(single):
    model_dir, _ = single
    specs = {"a.weight": WeightSpec((3, 4)), "b.bias": WeightSpec((5,))}
    specs.update({f"m{i}": WeightSpec((1,)) for i in range(25)})
    with pytest.raises(WeightError) as info:
        _load(model_dir, specs)
    assert "25 tensor(s) missing" in str(info.value) and "and 15 more" in str(info.value)


def test_unexpected_tensor_named(single):
    model_dir, _ = single
    with pytest.raises(WeightError, match=r"unexpected[^\n]*\n  b\.bias"):
        _load(model_dir, {"a.weight": WeightSpec((3, 4))})


def test_misshaped_names_both_shapes(single):
    model_dir, _ = single
    specs = {"a.weight": WeightSpec((4, 3)), "b.bias": WeightSpec((5,))}
    with pytest.raises(WeightError, match=r"a\.weight: checkpoint has shape \(3, 4\), the spec expects \(4, 3\)"):
        _load(model_dir, specs)


def test_integer_dtype_rejected(tmp_path):
    save_file({"a": torch.arange(4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="a: checkpoint dtype I64"):
        _load(tmp_path, {"a": WeightSpec((4,))})


def test_ignore(single):
    model_dir, _ = single
    out = _load(model_dir, {"a.weight": WeightSpec((3, 4))}, ignore=lambda n: n.startswith("b."))
    assert set(out) == {"a.weight"}


def test_progress_called(tmp_path):
    save_file({"x": _rand(2), **{f"e{i}": _rand(3) for i in range(4)}}, str(tmp_path / "model.safetensors"))
    calls = []
    _load(tmp_path, {"x": WeightSpec((2,)), "e": WeightSpec((4, 3), parts=("e0", "e1", "e2", "e3"))},
          progress=lambda done, total: calls.append((done, total)))
    assert calls == [(i, 5) for i in range(6)]


def _fp8_reference(weight, scale, block=128):
    """Dequantise one block at a time, independently of the vectorised code."""
    out = torch.empty(weight.shape, dtype=torch.float64)
    rows, cols = weight.shape
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            out[i:i + block, j:j + block] = weight[i:i + block, j:j + block].double() * float(scale[i // block, j // block])
    return out


def _fp8_weight(rows, cols):
    w = (torch.randn(rows, cols) * 2).to(torch.float8_e4m3fn)
    scale = torch.rand((rows + 127) // 128, (cols + 127) // 128) + 0.1
    return w, scale


def test_fp8_dequant_matches_reference():
    w, scale = _fp8_weight(200, 130)  # partial edge blocks in both dims
    got = dequantize(w, (scale,), FP8)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _fp8_reference(w, scale), rtol=1e-6, atol=0)


def test_fp8_dequant_rejects_wrong_scale_shape():
    w, _ = _fp8_weight(200, 130)
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        dequantize(w, (torch.ones(1, 2),), FP8)


def test_fp8_checkpoint_loads_as_stored(tmp_path):
    w, scale = _fp8_weight(130, 20)
    save_file({"p.weight": w, "p.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    specs = {"p.weight": WeightSpec((130, 20), format="fp8_e4m3_block128"),
             "p.weight_scale_inv": WeightSpec((2, 1), keep_fp32=True)}
    out = _load(tmp_path, specs, dtype=torch.bfloat16)
    assert out["p.weight"].dtype == torch.float8_e4m3fn and torch.equal(out["p.weight"].view(torch.uint8),
                                                                        w.view(torch.uint8))
    assert out["p.weight_scale_inv"].dtype == torch.float32 and torch.equal(out["p.weight_scale_inv"], scale)


def test_fp8_checkpoint_loads_dequantised_on_request(tmp_path):
    w, scale = _fp8_weight(130, 20)
    save_file({"p.weight": w, "p.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    out = _load(tmp_path, {"p.weight": WeightSpec((130, 20))}, "dtype", dtype=torch.bfloat16)  # scale hidden
    assert out["p.weight"].dtype == torch.bfloat16
    torch.testing.assert_close(out["p.weight"], _fp8_reference(w, scale).to(torch.bfloat16))


def test_fp8_where_the_spec_expects_the_model_dtype_names_the_tensor(tmp_path):
    w, scale = _fp8_weight(4, 4)
    save_file({"p.weight": w, "p.weight_scale_inv": scale}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"p.weight: the checkpoint stores it as F8_E4M3 .* weight_format='dtype'"):
        _load(tmp_path, {"p.weight": WeightSpec((4, 4))})


def test_ignoring_fp8_weight_ignores_its_scale(tmp_path):
    w, scale = _fp8_weight(4, 4)
    save_file({"p.weight": w, "p.weight_scale_inv": scale, "q": _rand(2)}, str(tmp_path / "model.safetensors"))
    out = _load(tmp_path, {"q": WeightSpec((2,))}, ignore=lambda n: n == "p.weight")
    assert set(out) == {"q"}


def test_transformers_deepseek_v2_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        vocab_size=61, hidden_size=24, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=6,
        v_head_dim=8, first_k_dense_replace=1,
    )
    model = transformers.DeepseekV2ForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    assert load_config(tmp_path)["n_routed_experts"] == 4
    ckpt = Checkpoint.open(tmp_path)
    parts = tuple(f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(4))
    assert set(parts) <= ckpt.names()
    # Load everything else as-is so the unexpected-tensor check passes too.
    specs = {n: WeightSpec(ckpt.shape(n)) for n in ckpt.names() if ".mlp.experts." not in n}
    specs["model.layers.1.mlp.experts.gate_proj"] = WeightSpec((4, 12, 24), parts=parts)
    ignore = lambda n: ".mlp.experts." in n and ".gate_proj." not in n  # noqa: E731
    out = load_weights(ckpt, specs, dtype=torch.float32, device="cpu", ignore=ignore)
    experts = model.model.layers[1].mlp.experts  # transformers 5 fuses experts in memory
    assert torch.equal(out["model.layers.1.mlp.experts.gate_proj"], experts.gate_up_proj[:, :12].detach())
    assert torch.equal(out["model.layers.0.self_attn.kv_b_proj.weight"],
                       model.model.layers[0].self_attn.kv_b_proj.weight.detach())


# ---- stacks with slices of a checkpoint tensor (shared experts ahead of the routed ones) ---------

E, S, M, D = 3, 2, 6, 4     # routed experts, shared experts, moe_intermediate, hidden
SHARED = "mlp.shared_experts.{}.weight"
ROUTED = "mlp.experts.{}.{}.weight"


def _shared_stack_specs(role_shapes=None) -> dict[str, WeightSpec]:
    """gate_proj [E+S, M, D] (shared rows sliced along dim 0) and down_proj [E+S, D, M] (columns,
    dim 1), as ir/passes/fuse_shared_experts.py binds them; `role_shapes` overrides `stored`."""
    stored = {"gate_proj": (S * M, D), "down_proj": (D, S * M), **(role_shapes or {})}
    specs = {}
    for role, dim, shape in (("gate_proj", 0, (M, D)), ("down_proj", 1, (D, M))):
        parts = tuple(ROUTED.format(e, role) for e in range(E)) + tuple(
            WeightSlice(SHARED.format(role), dim, s * M, (s + 1) * M, stored[role]) for s in range(S))
        specs[f"mlp.experts.*+shared_experts.{role}.weight"] = WeightSpec((E + S, *shape), parts=parts)
    return specs


def _shared_checkpoint(tmp_path, dtype=torch.float32, drop=()):
    tensors = {ROUTED.format(e, "gate_proj"): _rand(M, D, dtype=dtype) for e in range(E)}
    tensors.update({ROUTED.format(e, "down_proj"): _rand(D, M, dtype=dtype) for e in range(E)})
    tensors[SHARED.format("gate_proj")] = _rand(S * M, D, dtype=dtype)
    tensors[SHARED.format("down_proj")] = _rand(D, S * M, dtype=dtype)
    tensors = {k: v for k, v in tensors.items() if k not in drop}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tensors


def _expected_stacks(t) -> dict[str, torch.Tensor]:
    """The stacks built by hand: routed experts, then the shared MLP cut into S experts."""
    gate = torch.cat([torch.stack([t[ROUTED.format(e, "gate_proj")] for e in range(E)]),
                      t[SHARED.format("gate_proj")].reshape(S, M, D)])
    down = torch.cat([torch.stack([t[ROUTED.format(e, "down_proj")] for e in range(E)]),
                      torch.stack([t[SHARED.format("down_proj")].narrow(1, s * M, M) for s in range(S)])])
    return {"mlp.experts.*+shared_experts.gate_proj.weight": gate,
            "mlp.experts.*+shared_experts.down_proj.weight": down}


def test_a_stack_of_whole_tensors_and_slices_loads_as_their_concatenation(tmp_path):
    tensors = _shared_checkpoint(tmp_path)
    ckpt, calls = Checkpoint.open(tmp_path), []
    out = load_weights(ckpt, _shared_stack_specs(), dtype=torch.float32, device="cpu",
                       progress=lambda done, total: calls.append((done, total)))
    for name, want in _expected_stacks(tensors).items():
        assert torch.equal(out[name], want), name
    # every slot is one read, counted: the shared tensors are read slice by slice, never whole
    assert calls == [(i, 2 * (E + S)) for i in range(2 * (E + S) + 1)]
    assert (SHARED.format("gate_proj"), (0, M, 2 * M)) in ckpt.reads
    assert (SHARED.format("down_proj"), (1, 0, M)) in ckpt.reads
    assert all(part is not None for name, part in ckpt.reads if "shared" in name)


def test_sources_name_each_sliced_tensor_once_with_its_stored_shape():
    spec = _shared_stack_specs()["mlp.experts.*+shared_experts.down_proj.weight"]
    assert spec.sources("x")[-1] == (SHARED.format("down_proj"), (D, S * M))
    assert [n for n, _ in spec.sources("x")].count(SHARED.format("down_proj")) == 1
    assert spec.read_count() == E + S


def test_a_missing_shared_tensor_is_named_once(tmp_path):
    _shared_checkpoint(tmp_path, drop=(SHARED.format("gate_proj"),))
    with pytest.raises(WeightError) as info:
        _load(tmp_path, _shared_stack_specs())
    msg = str(info.value)
    assert "1 tensor(s) missing" in msg and msg.count(SHARED.format("gate_proj")) == 1
    assert f"{SHARED.format('gate_proj')} (expected shape {(S * M, D)})" in msg


def test_a_tensor_two_stacks_slice_is_checked_once(tmp_path):
    save_file({"a": _rand(M, D)}, str(tmp_path / "model.safetensors"))
    part = WeightSlice("shared", 0, 0, M, (S * M, D))
    specs = {"x": WeightSpec((2, M, D), parts=("a", part)), "y": WeightSpec((1, M, D), parts=(part,))}
    with pytest.raises(WeightError, match="1 tensor\\(s\\) missing") as info:
        _load(tmp_path, specs)
    assert str(info.value).count("shared") == 1


def test_a_shared_tensor_of_another_stored_shape_is_reported(tmp_path):
    _shared_checkpoint(tmp_path)
    # a manifest whose slices (the right size) come from a tensor it says is wider than the checkpoint's
    specs = _shared_stack_specs({"down_proj": (D, S * M + 1)})
    with pytest.raises(WeightError, match=rf"down_proj\.weight: checkpoint has shape \({D}, {S * M}\), "
                                          rf"the spec expects \({D}, {S * M + 1}\)"):
        _load(tmp_path, specs)


@pytest.mark.parametrize("part,stored,problem", [
    ((0, 0, M + 1), (S * M, D), "has shape"),          # a slice bigger than the stack's slots
    ((0, S * M - 2, S * M + 4), (S * M, D), "outside"),  # past the end of its tensor
    ((2, 0, M), (S * M, D), "dim 0 or 1"),
])
def test_a_slice_that_does_not_fit_its_slot_is_a_one_line_weight_error(part, stored, problem):
    with pytest.raises(WeightError, match=problem) as info:
        WeightSpec((2, M, D), parts=("a", WeightSlice("shared", *part, stored)))
    assert "\n" not in str(info.value) and "shared" in str(info.value)


def test_fp8_slices_dequantise_their_blocks_on_request(tmp_path):
    """Slices of an FP8 tensor that start and end inside 128-blocks, along rows and columns."""
    Mf, Df = 100, 20
    gate, gate_scale = _fp8_weight(S * Mf, Df)
    down, down_scale = _fp8_weight(Df, S * Mf)
    routed = {"r.gate": _rand(Mf, Df), "r.down": _rand(Df, Mf)}
    save_file({"sh.gate": gate, "sh.gate_scale_inv": gate_scale, "sh.down": down, "sh.down_scale_inv": down_scale,
               **routed}, str(tmp_path / "model.safetensors"))
    specs = {"gate": WeightSpec((1 + S, Mf, Df), parts=("r.gate",) + tuple(
                 WeightSlice("sh.gate", 0, s * Mf, (s + 1) * Mf, (S * Mf, Df)) for s in range(S))),
             "down": WeightSpec((1 + S, Df, Mf), parts=("r.down",) + tuple(
                 WeightSlice("sh.down", 1, s * Mf, (s + 1) * Mf, (Df, S * Mf)) for s in range(S)))}
    out = _load(tmp_path, specs, "dtype")      # both scales hidden: no unexpected tensors
    gate_ref, down_ref = _fp8_reference(gate, gate_scale).float(), _fp8_reference(down, down_scale).float()
    torch.testing.assert_close(out["gate"][1:], gate_ref.reshape(S, Mf, Df))
    torch.testing.assert_close(out["down"][1:], torch.stack([down_ref.narrow(1, s * Mf, Mf) for s in range(S)]))
    assert torch.equal(out["gate"][0], routed["r.gate"]) and torch.equal(out["down"][0], routed["r.down"])


def test_a_sliced_part_round_trips_through_the_manifest():
    """weights_to_json writes a WeightSlice as {name, part, stored}; manifest_weight_specs reads it back."""
    import types

    from codegen.manifest import weights_to_json
    from ir.ops import WeightInfo
    from runtime.model_loader import manifest_weight_specs
    routed = tuple(ROUTED.format(e, "down_proj") for e in range(E))
    slices = tuple(WeightSlice(SHARED.format("down_proj"), 1, s * M, (s + 1) * M, (D, S * M)) for s in range(S))
    name = "mlp.experts.*+shared_experts.down_proj.weight"
    G = types.SimpleNamespace(graph={"weights": {name: WeightInfo((E + S, D, M), parts=routed + slices),
                                                 "mlp.experts.*.gate_proj.weight": WeightInfo((E, M, D), parts=routed)}})
    table = json.loads(json.dumps(weights_to_json([G])))
    assert table[name]["parts"][:E] == list(routed)
    assert table[name]["parts"][E + 1] == {"name": SHARED.format("down_proj"), "part": [1, M, 2 * M],
                                          "stored": [D, S * M]}
    specs = manifest_weight_specs(table)
    assert specs[name].parts == routed + tuple(
        WeightSlice(SHARED.format("down_proj"), 1, s * M, (s + 1) * M, (D, S * M)) for s in range(S))
    assert specs[name].shape == (E + S, D, M)
    assert specs["mlp.experts.*.gate_proj.weight"].parts == routed      # a plain stack is as it was


def test_a_malformed_manifest_part_is_a_one_line_weight_error():
    from runtime.model_loader import manifest_weight_specs
    for bad in ({"name": "b", "part": [0, 0], "stored": [4, 3]}, {"name": "b", "part": [0, 0, 3]}, 7):
        table = {"w": {"shape": [2, 3], "keep_fp32": False, "parts": ["a", bad]}}
        with pytest.raises(WeightError, match="weight w: a stacked part must be") as info:
            manifest_weight_specs(table)
        assert "\n" not in str(info.value)


def test_random_weights_cut_a_slice_from_the_whole_tensor_drawn_once(monkeypatch):
    """A stacked slice is the narrowed draw of its whole tensor under the same seed: the model with
    the shared experts stacked and the one with them apart are the same model."""
    from runtime import model_loader
    from runtime.model_loader import random_weights
    specs = _shared_stack_specs()
    whole = random_weights({SHARED.format("gate_proj"): WeightSpec((S * M, D)),
                            SHARED.format("down_proj"): WeightSpec((D, S * M))},
                           dtype=torch.float32, device="cpu", seed=5)
    routed = random_weights({ROUTED.format(e, "gate_proj"): WeightSpec((M, D)) for e in range(E)},
                            dtype=torch.float32, device="cpu", seed=5)
    draws = []
    real = model_loader._draw
    monkeypatch.setattr(model_loader, "_draw", lambda name, *a: draws.append(name) or real(name, *a))
    out = random_weights(specs, dtype=torch.float32, device="cpu", seed=5)
    gate, down = out["mlp.experts.*+shared_experts.gate_proj.weight"], out["mlp.experts.*+shared_experts.down_proj.weight"]
    assert torch.equal(gate[E:], whole[SHARED.format("gate_proj")].reshape(S, M, D))
    for s in range(S):
        assert torch.equal(down[E + s], whole[SHARED.format("down_proj")].narrow(1, s * M, M))
    for e in range(E):
        assert torch.equal(gate[e], routed[ROUTED.format(e, "gate_proj")])
    assert draws.count(SHARED.format("gate_proj")) == 1 and draws.count(SHARED.format("down_proj")) == 1
