"""End to end on the GPU: the cuda backend against transformers.

Tiny models in fp32 (logits within 1e-3 relative, greedy tokens equal), continuous
batching, and a full-size DeepSeek-V2-Lite-shaped model with random weights in bf16.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.e2e.hf_tiny import CONFIGS, build, hf_generate, hf_logits, load_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
REPORT = os.environ.get("DSGRAPH_E2E_REPORT")


def _report(key, value):
    print(f"E2E {key} {value}")
    if REPORT:
        data = json.load(open(REPORT)) if os.path.exists(REPORT) else {}
        data[key] = value
        json.dump(data, open(REPORT, "w"), indent=1)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    from runtime import Engine
    path = build(request.param, tmp_path_factory.mktemp(request.param))
    model = load_reference(path).to(DEV)
    engine = Engine.from_pretrained(path, backend="cuda", device=DEV, dtype=torch.float32, block_size=5,
                                    num_blocks=64, max_seq_len=128)
    return request.param, model, engine


PROMPTS = [[3, 17, 5, 22, 9, 41, 7], [11], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_tiny_prefill_and_decode_match_transformers(tiny):
    name, model, engine = tiny
    worst = 0.0
    for decode_after in (None, 4):
        ours = engine.logits(PROMPTS, decode_after=decode_after)
        for p, o in zip(PROMPTS, ours):
            ref = hf_logits(model, p)
            rel = _rel(o, ref)
            worst = max(worst, rel)
            torch.testing.assert_close(o, ref, rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    _report(f"tiny_{name}_fp32_rel", worst)


def test_tiny_greedy_tokens_match_transformers(tiny):
    from runtime import SamplingParams
    name, model, engine = tiny
    outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    for p, o in zip(PROMPTS, outs):
        ref, _ = hf_generate(model, p, 12)
        assert o.token_ids == ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tiny_low_precision_error_within_transformers_own(name, dtype, tmp_path):
    """bf16 / fp16 end to end on every tiny model (the all-odd-widths one too: the vector-width
    fallbacks and alignment checks run here): our relative logit error against transformers fp32
    is at most 1.5x transformers' own error in the same dtype, prefill and paged decode."""
    from runtime import Engine
    path = build(name, tmp_path / name)
    ref_model = load_reference(path).to(DEV)
    low = load_reference(path).to(DEV, dtype)
    engine = Engine.from_pretrained(path, backend="cuda", device=DEV, dtype=dtype, block_size=5,
                                    num_blocks=64, max_seq_len=128)
    tag = "bf16" if dtype == torch.bfloat16 else "fp16"
    for decode_after in (None, 4):
        ours = engine.logits(PROMPTS, decode_after=decode_after)
        for p, o in zip(PROMPTS, ours):
            ref = hf_logits(ref_model, p)
            e_ours, e_hf = _rel(o, ref), _rel(hf_logits(low, p), ref)
            _report(f"tiny_{name}_{tag}_rel_ours_vs_transformers", f"{e_ours:.4g} / {e_hf:.4g}")
            assert e_ours <= 1.5 * e_hf + 1e-3, f"{name} {tag}: ours {e_ours:.4g} vs transformers {e_hf:.4g}"


def test_continuous_batching_equals_alone(tiny):
    from runtime import SamplingParams
    _, _, engine = tiny
    params = [SamplingParams(max_new_tokens=n) for n in (3, 9, 6)]
    together = engine.generate(PROMPTS, params)
    for p, sp, t in zip(PROMPTS, params, together):
        alone = engine.generate([p], sp)[0]
        assert alone.token_ids == t.token_ids


def test_sampling_on_gpu_is_seeded(tiny):
    from runtime import SamplingParams
    _, _, engine = tiny
    sp = SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    a = engine.generate(PROMPTS[:1], sp)[0].token_ids
    b = engine.generate(PROMPTS[:1], sp)[0].token_ids
    assert a == b


def _v2_lite_config():
    from transformers import DeepseekV2Config
    cfg = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "model_specs", "hf_configs",
                                      "deepseek_v2_lite.json")))
    keep = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype")}
    return DeepseekV2Config(**keep)


def hf_to_dsgraph_weights(model, graphs) -> dict:
    """Our weight dict from a transformers model in memory (it fuses routed experts; we stack them
    per role, shared experts' slices included where the graphs stack them)."""
    from runtime.hf_layout import read_transformers, transformers_state
    from runtime.model_loader import weight_specs
    state = transformers_state(model)
    out = {}
    for name, spec in weight_specs(graphs).items():
        t = read_transformers(state, name, spec.parts)
        out[name] = t.float() if spec.keep_fp32 else t.contiguous()
    return out


@pytest.fixture
def gpu_to_itself():
    """One memory-heavy test on the GPU at a time, across processes (run_isolated.py -j N runs each
    test in its own): two full-size tests at once need ~220 GB, and under -j 4 on the H200 both
    failed when they overlapped; each passes alone.  An exclusive lock on a file in the temp dir."""
    import fcntl
    import tempfile
    with open(os.path.join(tempfile.gettempdir(), "dsgraph-gpu-full-size.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory < 120e9,
                    reason="needs ~110 GB of GPU memory")
@pytest.mark.parametrize("prompt_len", [48, 300])
def test_full_size_v2_lite_bf16_error_within_transformers_bf16(prompt_len, gpu_to_itself):
    """bf16 end to end on a full-size V2-Lite-shaped model with random weights: our error against
    transformers fp32 is at most 1.5x transformers' own bf16 error (prefill + 16 decode steps).
    A 48-token prompt's prefill runs the experts on mma.sync tiles; 300 tokens is above
    moe.prefill_wgmma_above, where every expert runs on the sm_90a wgmma kernel."""
    from transformers import DeepseekV2ForCausalLM
    from runtime import Engine
    from runtime.model_loader import compile_graphs, resolve_spec
    cfg = _v2_lite_config()
    torch.manual_seed(0)
    with torch.device(DEV):
        model = DeepseekV2ForCausalLM(cfg).eval()
    g = torch.Generator(device="cpu").manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
    with torch.no_grad():
        full = model.generate(torch.tensor([prompt], device=DEV), max_new_tokens=16, min_new_tokens=16,
                              do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
        ref = model(torch.tensor([full], device=DEV)).logits[0].float()
        model.to(torch.bfloat16)
        hf_bf16 = model(torch.tensor([full], device=DEV)).logits[0].float()
    spec = resolve_spec(None, json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "model_specs",
                                                            "hf_configs", "deepseek_v2_lite.json"))))
    graphs = compile_graphs(spec).graphs
    weights = hf_to_dsgraph_weights(model, graphs)
    del model
    engine = Engine.from_spec(spec, weights=weights, backend="cuda", device=DEV, dtype=torch.bfloat16,
                              block_size=64, num_blocks=64, max_seq_len=4096)
    ours = engine.logits([full], decode_after=len(prompt))[0]
    n = len(prompt) - 1  # positions predicted by the prefill, then 16 decode steps
    for label, sl in (("prefill", slice(0, n + 1)), ("decode", slice(n + 1, None))):
        e_ours, e_hf = _rel(ours[sl], ref[sl]), _rel(hf_bf16[sl], ref[sl])
        suffix = "" if prompt_len == 48 else f"_{prompt_len}"
        _report(f"v2_lite_bf16_{label}{suffix}_rel_ours", e_ours)
        _report(f"v2_lite_bf16_{label}{suffix}_rel_transformers", e_hf)
        assert e_ours <= 1.5 * e_hf, f"{label}: ours {e_ours:.4g} vs transformers bf16 {e_hf:.4g}"


# -- chunked prefill (max_num_batched_tokens) ----------------------------------------------------
# Ragged prompts across the 5-row pages; caps of one token, a page less one, a page, a page and one,
# and ragged ones.  A chunk attends to the rows the earlier chunks cached (mla_gather_context, one kv_b
# GEMM over the whole context, the prefill attention with each query's position as its bound).
CHUNK_PROMPTS = [[(7 * i + 3) % 50 for i in range(23)], [11], [(5 * i + 1) % 50 for i in range(12)],
                 [8, 9, 10, 11, 12, 13]]
CHUNK_CAPS = (1, 4, 5, 6, 11)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny_path(request, tmp_path_factory):
    return request.param, build(request.param, tmp_path_factory.mktemp(f"chunk_{request.param}"))


def _engine(path, **kw):
    from runtime import Engine
    return Engine.from_pretrained(path, backend="cuda", device=DEV, dtype=torch.float32, block_size=5,
                                  num_blocks=64, max_seq_len=128, **kw)


def _spy_prefix_steps(engine) -> list:
    """Per forward call: (its phase, whether it was a prefill step over a cached prefix)."""
    seen, forward = [], engine.backend.forward

    def spy(phase, ids, ctx):
        seen.append((phase, phase == "prefill" and ctx.context_lens != ctx.query_lens))
        return forward(phase, ids, ctx)
    engine.backend.forward = spy
    return seen


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_chunked_prefill_logits_equal_the_unchunked_run(tiny_path, graphs):
    """fp32: every cap's logits equal one unchunked prefill's within 1e-5 (and after paged decode
    steps); with graphs on, the second pass replays the chunk steps' captured prefill graphs."""
    _, path = tiny_path
    whole = _engine(path)
    whole.backend.use_graphs = graphs
    want, want_dec = whole.logits(CHUNK_PROMPTS), whole.logits(CHUNK_PROMPTS, decode_after=4)
    for cap in CHUNK_CAPS:
        engine = _engine(path, max_num_batched_tokens=cap)
        engine.backend.use_graphs = graphs
        seen = _spy_prefix_steps(engine)
        for _ in range(2):
            for a, b in zip(engine.logits(CHUNK_PROMPTS), want):
                _close(a, b)
        for a, b in zip(engine.logits(CHUNK_PROMPTS, decode_after=4), want_dec):
            _close(a, b)
        assert any(prefix for _, prefix in seen), f"cap {cap}: no step attended to a cached prefix"
        if graphs:
            assert engine.backend.graphs_prefill.graphs, f"cap {cap}: no chunk step was captured"
        assert engine.tables.free_blocks == engine.tables.allocator.num_blocks


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_chunked_generation_with_decodes_beside_a_chunk_picks_the_same_tokens(tiny_path, graphs):
    """Greedy generation under a cap: the short prompts decode in the engine steps that still carry
    the long one's chunks (on cuda a decode step beside each chunk's step: CudaBackend.mixed_steps);
    tokens equal the unchunked run's and their logits within 1e-5."""
    from runtime import SamplingParams
    _, path = tiny_path
    ps = [CHUNK_PROMPTS[1], CHUNK_PROMPTS[0], [4, 2], CHUNK_PROMPTS[3] + CHUNK_PROMPTS[2]]
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logits=True)
    whole = _engine(path)
    whole.backend.use_graphs = graphs
    ref = whole.generate(ps, sp)
    for cap in (3, 7):
        engine = _engine(path, max_num_batched_tokens=cap)
        engine.backend.use_graphs = graphs
        seen = _spy_prefix_steps(engine)
        for a, b in zip(engine.generate(ps, sp), ref):
            assert a.token_ids == b.token_ids
            _close(a.logits, b.logits)
        first_decode = next(i for i, (phase, _) in enumerate(seen) if phase == "decode")
        assert any(prefix for _, prefix in seen[first_decode:]), \
            f"cap {cap}: no chunk over a cached prefix ran after decoding began"


def test_generate_cli_chunks_on_the_cuda_backend(tiny_path, capsys):
    """`dsgraph generate --max-num-batched-tokens 4 --backend cuda` runs (no refusal) and picks the
    unchunked run's greedy tokens for a prompt longer than the cap."""
    from runtime.cli import main
    _, path = tiny_path
    prompt = CHUNK_PROMPTS[0][:11]
    args = ["generate", "--model", str(path), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "6",
            "--backend", "cuda", "--device", DEV, "--dtype", "fp32", "--block-size", "5"]

    def ids(extra):
        assert main(args + extra) == 0
        line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("ids:"))
        return [int(x) for x in line.split(":", 1)[1].strip().split(",")]
    assert ids(["--max-num-batched-tokens", "4"]) == ids([])


def test_graph_replay_equals_eager_decode(tiny):
    """Decode steps replayed from captured CUDA graphs give exactly the eager launches' logits."""
    _, _, engine = tiny
    engine.backend.use_graphs = False
    eager = engine.logits(PROMPTS, decode_after=2)
    engine.backend.use_graphs = True
    graphed = engine.logits(PROMPTS, decode_after=2)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    graphs = engine.backend.graphs_decode
    assert graphs.graphs, "no decode graph was captured"
    # The engine wrote its steps straight into the graphs' own buffers (no refill copies): the last
    # decode step is the longest prompt's last position, alone.
    x = graphs.inputs(1, engine.blocks_per_seq, DEV)
    assert x.positions.tolist() == [len(PROMPTS[2]) - 1]
    assert any(cap.inputs["positions"] is x.positions for cap in graphs.graphs.values())
    # Every graph dropped (as the bench drops them to capture a step with PDL off): the next
    # captures take a new memory pool and replay the same logits.
    graphs.graphs.clear()
    again = engine.logits(PROMPTS, decode_after=2)
    for a, b in zip(eager, again):
        assert torch.equal(a, b)
    assert graphs.graphs, "no decode graph was captured again"


def test_prefill_graph_replay_equals_eager(tiny):
    """A prefill whose sizes came before replays its captured graph (cuda_graphs.PrefillGraphs)
    with the step's own tokens, lengths and cache pages: exactly the eager launches' logits, and
    the same tokens after.  The first sighting runs eagerly; the second, the same sizes with other
    tokens and the prompts' lengths in another order, is captured; the first prompts again replay."""
    _, _, engine = tiny
    be = engine.backend
    other = [[(t * 7 + 3) % engine.vocab for t in p] for p in reversed(PROMPTS)]   # same sizes, other data
    be.use_graphs = False
    want = [engine.logits(PROMPTS), engine.logits(other), engine.logits(PROMPTS)]
    be.use_graphs = True
    be.graphs_prefill.graphs.clear()
    be.graphs_prefill.seen.clear()
    got = [engine.logits(PROMPTS)]
    assert not be.graphs_prefill.graphs, "a shape's first step runs eagerly"
    got += [engine.logits(other), engine.logits(PROMPTS)]
    assert len(be.graphs_prefill.graphs) >= 1, "no prefill graph was captured"
    for i, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"call {i}: graph replay and eager launches differ"


def test_steps_share_the_planned_arena_and_graphs_follow_it_when_it_grows(tiny):
    """A step's values live in its phase's arena (codegen/memplan.py), which its graphs capture: when
    the arena grows (a larger step), the phase's graphs are dropped, captured again on the new one,
    and replay exactly the eager logits."""
    _, _, engine = tiny
    be = engine.backend
    be.use_graphs = False
    want = engine.logits(PROMPTS)
    be.use_graphs = True
    be.graphs_prefill.seen.clear()
    for _ in range(2):
        got = engine.logits(PROMPTS)
    assert be.graphs_prefill.graphs, "no prefill graph was captured"
    arena = be.arenas["prefill"]
    be._arena("prefill", arena.numel() + 1, torch.device(DEV))   # as a larger step grows it
    assert be.arenas["prefill"].data_ptr() != arena.data_ptr() and not be.graphs_prefill.graphs
    del arena
    for _ in range(2):
        got = engine.logits(PROMPTS)
    assert be.graphs_prefill.graphs, "no prefill graph was captured on the new arena"
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_an_arena_grown_in_a_captures_warm_up_leaves_the_capture_a_live_pool(tiny):
    """A decode graph of a larger batch whose warm-up grows the arena drops the phase's other graphs
    and, with the last of them, torch's pool: the capture draws on a fresh pool (on the dead one
    torch fails an internal assert) and replays the eager logits."""
    _, _, engine = tiny
    be = engine.backend
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0]]
    be.use_graphs = False
    want = engine.logits(prompts, decode_after=3)
    be.use_graphs = True
    be.release_arenas()
    engine.logits(prompts[:1], decode_after=3)
    assert be.graphs_decode.graphs, "no decode graph was captured"
    forward, grown = be._forward, []

    def growing_forward(phase, *args, **kw):       # as a new largest step grows the arena
        if phase == "decode" and not grown:
            grown.append(be.arenas["decode"].numel())
            be._arena("decode", grown[0] + 1, torch.device(DEV))
        return forward(phase, *args, **kw)

    be._forward = growing_forward
    try:
        got = engine.logits(prompts, decode_after=3)
    finally:
        del be._forward
    assert grown and be.arenas["decode"].numel() > grown[0] and be.graphs_decode.graphs
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_pdl_off_gives_exactly_the_same_logits(tiny):
    """Programmatic dependent launch (on by default: every engine here runs it, prefill eagerly and
    decode in captured graphs) changes when kernels start, never what they compute: the same model
    with every launch plain gives the same logits, eager and graphed."""
    from runtime import Engine
    _, _, engine = tiny
    launches = [la for p in engine.backend.plans.values() for la in p.launches]
    assert any(la.pdl for la in launches), "the default engine launches no kernel with PDL"
    off = Engine.from_spec(engine.spec, weights=engine.backend.weights, backend="cuda", device=DEV,
                           dtype=torch.float32, block_size=5, num_blocks=64, max_seq_len=128, pdl=False)
    assert not any(la.pdl for p in off.backend.plans.values() for la in p.launches)
    try:
        for graphs in (False, True):
            engine.backend.use_graphs = off.backend.use_graphs = graphs
            for a, b in zip(engine.logits(PROMPTS, decode_after=2), off.logits(PROMPTS, decode_after=2)):
                assert torch.equal(a, b), f"PDL on and off differ (decode graphs {'on' if graphs else 'off'})"
    finally:
        engine.backend.use_graphs = True


def test_bad_input_on_the_gpu_path_fails_before_any_kernel(tiny, tmp_path):
    from codegen.bundle import BundleError, compile_bundle
    from runtime import Engine, InputError
    name, _, engine = tiny
    with pytest.raises(InputError, match="out of range"):
        engine.logits([[1, 2, engine.vocab]])
    with pytest.raises(InputError, match="holds at most"):
        engine.logits([[1] * (engine.max_seq_len + 1)])
    # A bundle compiled for another architecture is refused, not launched.
    other = compile_bundle(engine.spec, tmp_path / "sm80", arch="sm_80", dtype="fp32", block_size=5,
                           cache_dir=tmp_path / "cache")
    with pytest.raises(BundleError, match="compiled for sm_80"):
        Engine.from_spec(None, bundle=other.path, device=DEV)
    # Tokens after the failures are unchanged: nothing leaked into another sequence's cache.
    from runtime import SamplingParams
    a = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0].token_ids
    b = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0].token_ids
    assert a == b


def test_a_bundle_from_dsgraph_compile_runs_with_the_compiler_disabled(tiny, tmp_path, monkeypatch):
    """`dsgraph compile` -> Engine.from_pretrained(model_dir, bundle=DIR): the engine runs the manifest
    as written.  Every compiler entry point raises during the load; the logits equal the engine that
    compiled the same spec itself."""
    import codegen.bundle
    import codegen.lower
    import codegen.nvrtc
    import ir.graph
    import ir.passes
    from runtime import Engine
    from runtime.cli import main
    name, _, engine = tiny
    spec = tmp_path / "spec.yaml"
    spec.write_text(engine.spec.text)
    path = build(name, tmp_path / "model")
    assert main(["compile", str(spec), "-o", str(tmp_path / "b"), "--dtype", "fp32", "--block-size", "5",
                 "--cache-dir", str(tmp_path / "cache")]) == 0

    def forbid(*_, **__):
        raise AssertionError("loading a bundle ran the compiler")
    for mod, fn in ((ir.passes, "run_pipeline"), (ir.graph, "build_graph"), (codegen.lower, "lower_graph"),
                    (codegen.nvrtc, "compile_cubin"), (codegen.bundle, "plan_spec"),
                    (codegen.bundle, "compile_bundle")):
        monkeypatch.setattr(mod, fn, forbid)
    ours = Engine.from_pretrained(path, bundle=tmp_path / "b", num_blocks=64, max_seq_len=128)
    assert ours.backend.name == "cuda" and ours.block_size == 5 and ours.dtype == torch.float32
    for a, b in zip(ours.logits(PROMPTS, decode_after=3), engine.logits(PROMPTS, decode_after=3)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
