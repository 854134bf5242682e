"""`dsgraph plan` and runtime/planner.py: per-GPU weights agree with the single-GPU estimate and
with ir/parallel.py's split, the KV cache is every rank's, the roofline reproduces the measurement
it is built on, and what cannot work says why in one line."""
from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest
import torch

from codegen.paths import MODEL_SPECS_DIR
from ir.graph import build_graph
from ir.parallel import ParallelError, sharded_shape, weight_shard
from ir.spec import load_spec
from runtime import bench, planner
from runtime.cli import main
from runtime.engine import estimate_memory
from runtime.errors import InputError
from runtime.kv_cache import PagedLatentCache
from runtime.model_loader import compile_graphs, weight_specs

ROOT = Path(__file__).resolve().parents[2]
PLAN_EXAMPLE = ROOT / "docs" / "PARALLEL.md"   # the `dsgraph plan` example users read
SHIPPED = ("deepseek_tiny", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")


def spec_path(name: str) -> str:
    return str(MODEL_SPECS_DIR / f"{name}.yaml")


@pytest.fixture(scope="module")
def specs():
    return {name: load_spec(spec_path(name), check=False) for name in SHIPPED}


def bound(spec) -> dict:
    return weight_specs({"decode": build_graph(spec, "decode")})


def checkpoint_reads(specs: dict) -> dict:
    """checkpoint tensor -> (the elements read of it, fp32) over WeightSpecs (stack parts and
    slices of one tensor add up)."""
    out = {}
    for name, s in specs.items():
        for part in s.parts if s.parts is not None else (name,):
            key = getattr(part, "name", part)
            n = math.prod(part.shape()) if hasattr(part, "shape") else math.prod(s.shape[1:] if s.parts else s.shape)
            size, fp32 = out.get(key, (0, s.keep_fp32))
            out[key] = (size + n, fp32)
    return out


@pytest.mark.parametrize("name", ["deepseek_tiny", "deepseek_v2_lite"])
def test_one_gpu_weights_are_the_engines_estimate(specs, name):
    spec = specs[name]
    engine_specs = weight_specs(compile_graphs(spec).graphs)     # after the passes, as the engine binds them
    # what the planner's shortcut relies on: the graph before the passes reads the same checkpoint
    # tensors, as many bytes (fuse_shared_experts binds the shared MLP in the expert stacks, but
    # the planner needs the checkpoint's names for ir/parallel.py's split rules)
    assert checkpoint_reads(bound(spec)) == checkpoint_reads(engine_specs)
    (one,) = planner.plan_deployment(spec, (1,), dtype="bf16", batch=1, context=64).plans
    est = estimate_memory(spec, engine_specs, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert one.weights == est.weights


def test_deepseek_v3_holds_its_published_671b_parameters(specs):
    params = sum(math.prod(s.shape) for s in bound(specs["deepseek_v3"]).values())
    assert abs(params / 671e9 - 1) < 0.01


@pytest.mark.parametrize("name,world", [("deepseek_tiny", 2), ("deepseek_tiny", 4), ("deepseek_v2_lite", 16),
                                        ("deepseek_v3", 8), ("deepseek_v3", 64)])
def test_the_ranks_parts_add_up_to_the_whole(specs, name, world):
    spec = specs[name]
    whole = bound(spec)
    ranks = [planner.rank_weight_specs(whole, spec.model, world, r) for r in range(world)]
    for w, s in whole.items():
        held = [math.prod(rank[w].shape) for rank in ranks]
        replicated = weight_shard(w, s.shape, spec.model, world, 0).kind == "replicated"
        assert sum(held) == math.prod(s.shape) * (world if replicated else 1), w
        assert len(set(held)) == 1, w                               # rank 0 stands for every rank
    sizes = {sum(math.prod(x.shape) for x in rank.values()) for rank in ranks}
    assert len(sizes) == 1


@pytest.mark.parametrize("name", SHIPPED)
def test_more_gpus_never_mean_more_weights_per_gpu(specs, name):
    plans = planner.plan_deployment(specs[name], dtype="bf16", batch=8, context=1024).plans
    assert [p.gpus for p in plans] == sorted(p.gpus for p in plans) and len(plans) >= 2
    for a, b in zip(plans, plans[1:]):
        assert b.weights <= a.weights and b.read["weights"] <= a.read["weights"]
        assert b.read["routed_experts"] <= a.read["routed_experts"]


def test_the_kv_cache_is_every_ranks_and_what_the_engine_allocates(specs):
    spec = specs["deepseek_tiny"]
    plans = planner.plan_deployment(spec, dtype="bf16", batch=3, context=65).plans
    assert len({p.kv_cache for p in plans}) == 1 and len(plans) >= 3
    pages = 3 * math.ceil(65 / 64)                    # the engine's 64-token pages
    cache = PagedLatentCache(spec.dims["layers"], pages, 64, spec.model.cache_width, torch.bfloat16, "cpu")
    assert plans[0].kv_cache == cache.nbytes


def test_deepseek_v3_in_bf16_needs_16_h200(specs):
    """671B parameters in bf16 are 1.34 TB: 8 x 141 GB leave 170 GB of weights per GPU."""
    plans = {p.gpus: p for p in planner.plan_deployment(specs["deepseek_v3"], dtype="bf16").plans}
    assert [n for n, p in plans.items() if not p.fits] == [1, 2, 4, 8]
    assert plans[8].weights > planner.GPU_MEM_GB * planner.GB      # the weights alone, before any cache
    assert plans[16].fits and plans[16].max_batch >= 32 and plans[16].free > 0
    assert plans[16].max_context >= 4096


def test_one_gpu_decode_bytes_are_the_benchs(specs):
    """The bench counts the same bytes (leaving out norms and the embedding rows)."""
    spec = specs["deepseek_v2_lite"]
    d = spec.dims
    for batch, context in ((1, 512), (32, 4096)):
        (one,) = planner.plan_deployment(spec, (1,), batch=batch, context=context).plans
        theirs = bench.decode_bytes(d, spec.plan.first_k_dense_replace, batch, context)
        assert one.read["total"] == pytest.approx(theirs["total"], rel=2e-3)
        assert one.read["routed_experts"] == pytest.approx(theirs["routed_experts"], rel=1e-9)
        assert one.read["kv_cache"] == theirs["cache"]


def test_the_roofline_reproduces_the_measurement_it_is_built_on(specs):
    spec = specs["deepseek_v2_lite"]
    for case in planner.load_measured()["decode"]:
        (one,) = planner.plan_deployment(spec, (1,), batch=case["batch"], context=case["context"]).plans
        assert one.allreduce_ms == 0 and one.step_ms == pytest.approx(case["ms"], rel=3e-3)


def test_all_reduce_volume_and_which_link(specs):
    spec = specs["deepseek_v3"]
    hw = planner.hardware(batch=4, context=512)
    message = 4 * spec.dims["hidden"] * 2
    count = 2 * spec.dims["layers"]
    sent2, t2 = planner.allreduce_cost(spec, torch.bfloat16, 2, 4, hw)
    assert sent2 == count * message                              # 2 (N-1)/N = 1 at N = 2
    sent8, t8 = planner.allreduce_cost(spec, torch.bfloat16, 8, 4, hw)
    sent16, t16 = planner.allreduce_cost(spec, torch.bfloat16, 16, 4, hw)
    assert t8 == pytest.approx(sent8 / hw.link_bw + count * hw.link_latency)
    assert t16 == pytest.approx(sent16 / hw.net_bw + count * hw.net_latency)   # beyond one node of 8
    assert planner.allreduce_cost(spec, torch.bfloat16, 1, 4, hw) == (0.0, 0.0)


def test_refused_degrees_name_the_reason(specs, capsys):
    d = planner.plan_deployment(specs["deepseek_v2_lite"], dtype="bf16", batch=1, context=512)
    assert set(d.refused) == {32, 64} and "heads (num_attention_heads) = 16" in d.refused[32][0]
    assert main(["plan", spec_path("deepseek_v2_lite")]) == 0
    out = capsys.readouterr().out
    assert "  32: refused: heads (num_attention_heads) = 16 does not divide by 32 ranks" in out
    # --gpus as the default list: a refused row with its reason, the other counts planned
    assert main(["plan", spec_path("deepseek_v3"), "--gpus", "16,3"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "   3: refused: heads (num_attention_heads) = 128 does not divide by 3 ranks" in out
    assert "routed experts" in out and any(line.split()[:1] == ["16"] for line in out.splitlines())
    assert main(["plan", spec_path("deepseek_v3"), "--gpus", "8,3"]) == 2     # and nothing fits: still an error
    out, err = capsys.readouterr()
    assert "   3: refused: heads" in out and err.count("\n") == 1
    assert err.startswith("dsgraph: error: deepseek_v3 in bfloat16 does not fit on 8 x 141 GB")
    assert "does not fit" not in out                                          # the reason once, not twice


def test_the_table_then_one_line_when_nothing_asked_for_fits(capsys):
    assert main(["plan", spec_path("deepseek_v3"), "--gpus", "8"]) == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("dsgraph: error: deepseek_v3 in bfloat16 does not fit on 8 x 141 GB")
    assert "weights 173.0 GB" in err and "> 141 GB" in err
    row = next(line.split() for line in out.splitlines() if line.split()[:1] == ["8"])
    assert row[1] == "173.0" and row[-2:] == ["-", "-"]
    assert "does not fit" not in out                                          # the reason once: the error line
    assert main(["plan", spec_path("deepseek_v3"), "--gpus", "8,16", "--context", "8192", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    copy = json.loads((ROOT / "runtime" / "bench_h200.json").read_text())["copy_bandwidth_GBps"] / 1000
    assert f"measured: copy bandwidth {copy:.2f} TB/s" in out and "max batch@8192" in out
    assert "   8: deepseek_v3 in bfloat16 does not fit" in out


def test_json_round_trips(specs, capsys):
    args = ["--gpus", "16,32", "--batch", "8", "--context", "2048", "--link-bw", "300", "--net-bw", "45"]
    assert main(["plan", spec_path("deepseek_v3"), "--json", *args]) == 0
    got = json.loads(capsys.readouterr().out)
    hw = planner.hardware(batch=8, context=2048, measured=planner.load_measured(), link_gbps=300, net_gbps=45)
    want = planner.plan_deployment(specs["deepseek_v3"], (16, 32), batch=8, context=2048, hw=hw).to_json()
    assert got == want
    assert [p["gpus"] for p in got["plans"]] == [16, 32] and got["hardware"]["net_bw"] == 45e9
    assert got["plans"][0]["tokens_per_s"] == pytest.approx(8 / (got["plans"][0]["step_ms"] / 1e3))


@pytest.mark.parametrize("argv,message", [
    (["--batch", "0"], "batch and context must be whole numbers >= 1"),
    (["--context", "200000"], "exceeds deepseek_v3's max_positions 163840"),
    (["--gpu-mem", "-1"], "gpu memory must be a positive number"),
    (["--bw-fraction", "1.5"], "fraction of copy bandwidth must be in (0, 1]"),
    (["--bench", "missing.json"], "no measured figures at missing.json"),
])
def test_bad_options_are_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", spec_path("deepseek_v3"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_a_foreign_json_is_not_a_bench_result(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps({"decode": [{"batch": 1}]}))
    with pytest.raises(InputError, match="is not a `dsgraph bench` result"):
        planner.load_measured(tmp_path / "b.json")


def test_a_shard_table_error_surfaces_as_a_parallel_error(specs):
    with pytest.raises(ParallelError):
        planner.rank_weight_specs(bound(specs["deepseek_tiny"]), specs["deepseek_tiny"].model, 3)
    assert sharded_shape((8, 4), weight_shard("x.weight", (8, 4), specs["deepseek_tiny"].model, 2, 1)) == (8, 4)


def test_the_documented_example_is_what_dsgraph_prints(capsys, monkeypatch):
    command, shown = re.search(r"^\$ (dsgraph plan [^\n]*)\n(.*?)^```", PLAN_EXAMPLE.read_text(encoding="utf-8"),
                               re.M | re.S).groups()
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out == shown, "refresh the `dsgraph plan` example in docs/PARALLEL.md"


# ---- FP8 weights: counted as stored -----------------------------------------------------

def test_deepseek_v3_with_fp8_weights_fits_8_h200(specs, capsys):
    """V3 as its checkpoints store it: the linears FP8 (one byte, plus a float32 scale per 128x128 block),
    the embedding, norms, routers and lm_head bf16.  Both spellings plan the same."""
    from runtime.convert import spec_in_format
    fp8 = spec_in_format(specs["deepseek_v3"], None, "fp8")
    whole = bound(fp8)
    fp8_bytes = sum(math.prod(s.shape) for s in whole.values() if s.format)
    scale_bytes = 4 * sum(math.prod(whole[n + "_scale_inv"].shape) for n, s in whole.items() if s.format)
    rest = 2 * sum(math.prod(s.shape) for n, s in whole.items()
                   if not s.format and not n.endswith("_scale_inv") and not s.keep_fp32)
    fp32 = 4 * sum(math.prod(s.shape) for n, s in whole.items() if s.keep_fp32 and not n.endswith("_scale_inv"))
    (one,) = planner.plan_deployment(fp8, (1,), dtype="bf16").plans
    assert one.weights == fp8_bytes + scale_bytes + rest + fp32
    assert 650e9 < fp8_bytes < 671e9 and scale_bytes < fp8_bytes / 4000
    (eight,) = planner.plan_deployment(fp8, (8,), dtype="bf16").plans
    assert eight.fits and eight.weights < 95e9 and eight.max_batch >= 32
    outputs = []
    for args in (["--dtype", "fp8"], ["--weights", "fp8"]):
        assert main(["plan", spec_path("deepseek_v3"), "--gpus", "8", "--json", *args]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1]
    assert outputs[0]["weight_formats"] == "fp8_e4m3_block128" and outputs[0]["plans"][0]["weights"] == eight.weights


def test_fp8_ranks_whose_slice_splits_a_block_are_refused(specs, capsys):
    assert main(["plan", spec_path("deepseek_v3"), "--dtype", "fp8", "--gpus", "8,32"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"32: refused: weight model\.layers\.0\.mlp\.down_proj\.weight .*does not fall on the 128-wide "
                     r"blocks", out)


def test_memory_says_how_many_whole_contexts_fit_and_a_steps_planned_activations(specs, capsys):
    """--memory: V2-Lite's whole 163,840-token context on one 80 GB GPU, as many sequences as the
    KV cache's room holds beside the weights and margin; and the planned activations per step size."""
    assert main(["plan", spec_path("deepseek_v2_lite"), "--gpus", "1", "--gpu-mem", "80", "--memory", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    p = got["plans"][0]
    spec = specs["deepseek_v2_lite"]
    per_seq = PagedLatentCache.bytes_per_block(spec.dims["layers"], 64, spec.model.cache_width, torch.bfloat16) \
        * math.ceil(163840 / 64)
    assert p["full_context_seqs"] == int((80e9 - p["weights"] - p["margin"]) // per_seq) >= 1
    assert any(f"{p['full_context_seqs']} sequence(s) of the whole 163840-token context" in line
               for line in got["memory"])
    prefill = next(line for line in got["memory"] if "prefill activations" in line)
    assert "2048 tok " in prefill and "16384 tok " in prefill, prefill
