"""The cuda backend's step plumbing on the CPU with DeepSeek-V3's FP8 weights (every decoder linear, kv_b
and the experts float8_e4m3fn with block scales): a real bundle of a tiny FP8 model (NVRTC without a GPU;
its dims on the FP8 kernels), read back and run by the backend from its manifest, the kernels replaced by
tests/runtime/test_cuda_backend_plumbing.py's stub that computes each node with its reference op (here on
kv_b and the other weights dequantised as the reference backend takes them).  So what the backend itself
does with FP8 weights -- bind the bytes and their scale companions to the launches, run the linears'
library calls above the skinny kernel's tokens on the dequantised weights -- is checked against the
reference backend, prefill and decode."""
from __future__ import annotations

import pytest
import torch

from codegen.bundle import compile_bundle, load_bundle
from codegen.kernel import WeightRef
from codegen.nvrtc import nvrtc_version
from ir import load_spec
from ir.config_to_spec import spec_from_config
from ir.formats import FP8
from ir.interpret import bound_weight
from runtime import Engine
from runtime.cuda_backend import CudaBackend
from runtime.model_loader import compile_graphs, random_weights, weight_specs
from test_cuda_backend_plumbing import ReferenceKernels, SteppedCuda
from tiny_engine import prompts

FP8_QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# V3-style, widths the FP8 kernels take (inner widths of 16, C of 32, N of 16), past one block: kv_b 168 x 160
CONFIG = {"model_type": "deepseek_v3", "vocab_size": 61, "hidden_size": 144, "intermediate_size": 160,
          "moe_intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 3, "kv_lora_rank": 160,
          "q_lora_rank": 48, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 24, "n_routed_experts": 6,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
          "routed_scaling_factor": 1.5, "max_position_embeddings": 128, "quantization_config": FP8_QUANT}
KV_B = "model.layers.0.self_attn.kv_b_proj.weight"


class DequantisingKernels(ReferenceKernels):
    """The stub kernels, each node's FP8 weights dequantised as the reference backend hands them to its op."""

    def run_all(self, launches, *, values, weights, **kw):
        G = self.graphs[self.phase]
        data = G.nodes[launches[0].nodes[0]]
        ins = [values[v] for v in data["inputs"] if isinstance(values.get(v), torch.Tensor)]
        plain = {**weights, **{n: bound_weight(G, weights, n, ins) for n in data["weights"].values()}}
        return super().run_all(launches, values=values, weights=plain, **kw)


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    spec = load_spec(spec_from_config(CONFIG, name="tiny_fp8"), file="tiny_fp8.yaml")
    model = compile_graphs(spec)
    weights = random_weights(weight_specs(model.graphs), dtype=torch.bfloat16, device="cpu", seed=7, std=0.3)
    out = tmp_path_factory.mktemp("fp8_plumbing")
    path = compile_bundle(spec, out / "bundle", dtype="bf16", block_size=4, cache_dir=out / "cache").path
    return model, weights, load_bundle(path, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="bf16", block_size=4)


@pytest.mark.slow
def test_the_backend_runs_an_fp8_bundle_as_the_reference_backend(fp8_model, monkeypatch):
    model, weights, loaded = fp8_model
    assert weights[KV_B].dtype == torch.float8_e4m3fn
    decode = [s for s in loaded.plans["decode"].steps if hasattr(s, "args")]   # the launches
    bound = {a.ref.name for s in decode if s.name.startswith(("mla_decode_query__", "mla_v_up__"))
             for a in s.args if isinstance(a.ref, WeightRef)}
    assert {KV_B, KV_B + "_scale_inv"} <= bound
    assert all("_wfp8__" in s.name for s in decode if s.name.startswith(("mla_decode_query__", "mla_v_up__")))
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.bfloat16, top_k=model.spec.dims["top_k"])
    stub = backend.runner = DequantisingKernels(model.graphs)
    fp8_calls = []
    library = CudaBackend._library_weight

    def spy(self, call, name, dtype):
        if call.attrs.get("weight_format") == FP8.name:
            fp8_calls.append(name)
        return library(self, call, name, dtype)
    monkeypatch.setattr(CudaBackend, "_library_weight", spy)
    kw = dict(device="cpu", dtype=torch.bfloat16, block_size=4)
    ours = Engine(model.spec, model.graphs, weights, backend_impl=backend, **kw)
    ref = Engine(model.spec, model.graphs, weights, backend="reference", **kw)
    ps = prompts([1, 5, 20], seed=3)     # a 26-token prefill: the linears' library calls (their FP8 fallback)
    for decode_after in (None, 2):
        # the same ops on the same dequantised weights and the same bf16 buffers: the same logits exactly
        for a, b in zip(ours.logits(ps, decode_after=decode_after), ref.logits(ps, decode_after=decode_after)):
            assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
    assert stub.calls > 0 and fp8_calls, "the FP8 linears' library calls did not run"


@pytest.mark.slow
def test_chunked_prefill_decompresses_the_context_with_the_fp8_kv_b(fp8_model, monkeypatch):
    """A prompt prefilled in chunks (max_num_batched_tokens) attends to the rows earlier chunks cached:
    kv_b decompresses each step's TK context rows through the library call, which dequantises the FP8
    kv_b; the logits are the reference backend's, chunked the same way, exactly."""
    model, weights, loaded = fp8_model
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.bfloat16, top_k=model.spec.dims["top_k"])
    backend.runner = DequantisingKernels(model.graphs)
    kv_b_rows = []
    library = CudaBackend._library_weight

    def spy(self, call, name, dtype):
        if name == KV_B:
            assert call.attrs.get("weight_format") == FP8.name
            kv_b_rows.append(call.inputs[0])
        return library(self, call, name, dtype)
    monkeypatch.setattr(CudaBackend, "_library_weight", spy)
    prefixed, forward = [], backend.forward
    backend.forward = lambda phase, ids, ctx: prefixed.append(ctx.context_lens != ctx.query_lens) or \
        forward(phase, ids, ctx)
    kw = dict(device="cpu", dtype=torch.bfloat16, block_size=4, max_num_batched_tokens=7)
    ours = Engine(model.spec, model.graphs, weights, backend_impl=backend, **kw)
    ref = Engine(model.spec, model.graphs, weights, backend="reference", **kw)
    ps = prompts([3, 17, 9], seed=5)
    for a, b in zip(ours.logits(ps), ref.logits(ps)):
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
    assert kv_b_rows, "prefill's kv_b library call did not run"
    assert any(prefixed), "no chunk attended to a cached prefix"


@pytest.mark.slow
def test_the_backend_binds_the_norms_fp8_rows(tmp_path, monkeypatch):
    """Tuning.linear.norm_fp8: the bundle's norms (the input norm, q_a_layernorm, the MoE / MLP input norm)
    run their qf8 launches beside the plain ones and the FP8 GEMMs bind their rows; the backend gives the rows
    buffers of their own, which the stub fills with each norm's reference outputs (rows included); the logits
    are the reference backend's exactly, prefill (a 26-token step: the FP8 GEMMs above 16 tokens) and decode.
    NVRTC is stubbed: the stub kernels run no machine code."""
    import hashlib

    import codegen.nvrtc as nvrtc
    from codegen.kernel import ValueRef
    from codegen.tuning import LinearTuning, Tuning
    from ir import PHASES, build_graph
    from ir.passes import run_pipeline
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    spec = load_spec(spec_from_config(CONFIG, name="tiny_fp8"), file="tiny_fp8.yaml")
    graphs = {ph: run_pipeline(build_graph(spec, ph), knobs=frozenset({"linear.norm_fp8"})) for ph in PHASES}
    plain = compile_graphs(spec).graphs
    weights = random_weights(weight_specs(plain), dtype=torch.bfloat16, device="cpu", seed=7, std=0.3)
    path = compile_bundle(spec, tmp_path / "bundle", dtype="bf16", block_size=4, cache_dir=tmp_path / "cache",
                          tuning=Tuning(linear=LinearTuning(norm_fp8=True))).path
    loaded = load_bundle(path, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="bf16", block_size=4)
    for phase in PHASES:
        steps = [s for s in loaded.plans[phase].steps if hasattr(s, "args")]
        written = {a.ref.name for s in steps if s.name.endswith("__qf8") for a in s.args if a.name == "hq"}
        read = {a.ref.name for s in steps for a in s.args if a.name == "xq" and isinstance(a.ref, ValueRef)}
        assert len(written) == 3 * CONFIG["num_hidden_layers"] and read and read <= written, (phase, written, read)
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.bfloat16, top_k=spec.dims["top_k"])
    stub = backend.runner = DequantisingKernels(graphs)
    kw = dict(device="cpu", dtype=torch.bfloat16, block_size=4)
    ours = Engine(spec, graphs, weights, backend_impl=backend, **kw)
    ref = Engine(spec, plain, weights, backend="reference", **kw)
    ps = prompts([1, 5, 20], seed=3)
    for decode_after in (None, 2):
        for a, b in zip(ours.logits(ps, decode_after=decode_after), ref.logits(ps, decode_after=decode_after)):
            assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
    assert stub.calls > 0


@pytest.mark.slow
def test_the_backend_binds_v_ups_fp8_rows(tmp_path, monkeypatch):
    """Tuning.linear.v_up_fp8 on CONFIG with v_head_dim 128 (a head's V columns one group), the FP8 GEMM from 17
    tokens (fp8_chunks_upto 0): decode at 20 sequences runs each layer's qf8 v_up and o_proj's gemm_fp8 on its
    rows (no quantiser); the backend gives the rows buffers, the stub fills them with v_up's reference outputs;
    the logits are the reference backend's exactly.  NVRTC is stubbed."""
    import hashlib

    import codegen.nvrtc as nvrtc
    from codegen.kernel import ValueRef
    from codegen.tuning import LinearTuning, Tuning
    from ir import PHASES, build_graph
    from ir.passes import run_pipeline
    monkeypatch.setattr(nvrtc, "compile_cubin", lambda source, name, **kw: nvrtc.CompileResult(
        cubin=b"CUBIN:" + hashlib.sha256(source.encode()).digest(), log=""))
    spec = load_spec(spec_from_config({**CONFIG, "v_head_dim": 128}, name="tiny_fp8"), file="tiny_fp8.yaml")
    graphs = {ph: run_pipeline(build_graph(spec, ph), knobs=frozenset({"linear.v_up_fp8", "linear.norm_fp8"}))
              for ph in PHASES}
    plain = compile_graphs(spec).graphs
    weights = random_weights(weight_specs(plain), dtype=torch.bfloat16, device="cpu", seed=7, std=0.3)
    path = compile_bundle(spec, tmp_path / "bundle", dtype="bf16", block_size=4, cache_dir=tmp_path / "cache",
                          tuning=Tuning(linear=LinearTuning(v_up_fp8=True, fp8_chunks_upto=0))).path
    loaded = load_bundle(path, arch="sm_90", nvrtc_version=nvrtc_version(), dtype="bf16", block_size=4)
    steps = [s for s in loaded.plans["decode"].steps if hasattr(s, "args")]
    written = {a.ref.name for s in steps if s.family == "mla_v_up" and s.name.endswith("__qf8")
               for a in s.args if a.name == "hq"}
    read = {a.ref.name for s in steps for a in s.args if a.name == "xq" and isinstance(a.ref, ValueRef)}
    assert len(written) == CONFIG["num_hidden_layers"] and written <= read, (written, read)
    backend = SteppedCuda.from_bundle(loaded, weights, dtype=torch.bfloat16, top_k=spec.dims["top_k"])
    stub = backend.runner = DequantisingKernels(graphs)
    kw = dict(device="cpu", dtype=torch.bfloat16, block_size=4)
    ours = Engine(spec, graphs, weights, backend_impl=backend, **kw)
    ref = Engine(spec, plain, weights, backend="reference", **kw)
    ps = prompts([3] * 20, seed=4)
    for a, b in zip(ours.logits(ps, decode_after=2), ref.logits(ps, decode_after=2)):
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
    assert stub.calls > 0
