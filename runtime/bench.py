"""`dsgraph bench`: DeepSeek-V2-Lite (random bf16 weights, full size) on one GPU, against the
memory roofline and against transformers eager, in one run.

What it prints and writes (JSON):
  - the measured device-to-device copy bandwidth (the ceiling for memory-bound decode);
  - prefill tokens/s for 1x2048 and 32x512;
  - decode ms/step and tokens/s for batch 1/8/32/128 x context 512/4096, the bytes each step
    must read (touched expert weights, attention, dense layer, lm_head, cache) and the
    achieved fraction of the copy bandwidth;
  - the same workloads through transformers (DeepseekV2ForCausalLM, eager, same weights);
  - a per-kernel breakdown of one decode step.

`--weights fp8`: the same model with DeepSeek-V3's FP8 weights (every decoder linear, kv_b and the
experts as float8_e4m3fn with a float32 scale per 128 x 128 block; the embedding, norms, router and
lm_head as before): the random bf16-scale weights quantised to V3's block layout, as
`Engine.from_pretrained(dir, weight_format="fp8")` does.  The floor then counts one byte a weight
plus its scales; the transformers side is skipped (it would run other, dequantised weights).

`--weights w8a8` / `w4a8`: the same model in Huawei msModelSlim's integer layout, as its config keys
quantize: w8a8_dynamic / moe_quantize: w4a8_dynamic prescribe (ir/config_to_spec.py
msmodelslim_weight_formats): every decoder linear int8 per output channel (W8A8_DYNAMIC), the routed
experts int8 too (w8a8) or packed int4 per channel (w4a8: W4A8_DYNAMIC, two a byte along the output
dim); kv_b, the router gate, the embedding, norms and lm_head float.  The random weights are drawn and
quantised on the GPU (model_loader.random_weights, one expert at a time); the floor counts one byte an
int8 weight, half a byte a packed int4 one, plus the float32 scale per output channel the kernels read
(matrix_bytes).  A spec that declares weight_formats itself (model_specs/deepseek_v3_1_w4a8_seed.yaml,
the seed checkpoint's shape) runs under the --weights they are.  Before the GPU is looked for, the spec
is lowered for the cuda backend, so a shape the kernels cannot serve (packed int4 with an odd width) is
the lowering's one line.

Memory (an 80 GB H100 runs every default case): a step's activations live in its phase's arena
(codegen/memplan.py), so the prefill cases add about a GB to the weights and the cache.  The
transformers model is a second copy of the weights; `transformers_placement` decides from the
GPU's measured free memory whether it loads beside the engine, after the engine's KV cache,
graphs and arenas are freed (made again for the profiles after it), or not at all (said in one
line; the engine's numbers are kept).
"""
from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import platform
import re
import sys
import time

from codegen.kernel import DEFAULTS

from .cli_args import add_tune_arg, block_size_arg, tuning_of, whole_number
from .timing import event_ms as _timeit

DECODE_CASES = [(1, 512), (8, 512), (32, 512), (128, 512), (256, 512), (1, 4096), (8, 4096), (32, 4096),
                (128, 4096)]
PREFILL_CASES = [(1, 2048), (32, 512)]
HF_DECODE_CASES = [(1, 512), (32, 512)]
MAX_BATCH, MAX_LENGTH = 256, 8192   # the engine the bench builds: max_num_seqs, max_seq_len
MAX_PROMPT = 32768                  # a prefill case's prompt at most (the engine's max_seq_len grows to it)
WEIGHTS = ("bf16", "fp8", "w8a8", "w4a8")   # --weights: the engine's weight storage

# The weight matrices decode_bytes / linear_bytes count, and each one's storage (an ir/formats.py name;
# absent: the activation dtype) under each --weights: what the spec bench_spec makes declares
# (weight_layout reads it back; a test holds the two together).
MATRICES = ("q", "kv_a", "kv_b", "o", "dense_ffn", "shared_experts", "routed_experts")
_INT8, _INT4 = "int8_channel", "int4_channel"
LAYOUTS = {
    "bf16": {},
    "fp8": dict.fromkeys(MATRICES, "fp8_e4m3_block128"),
    "w8a8": {m: _INT8 for m in MATRICES if m != "kv_b"},            # msModelSlim keeps kv_b_proj float
    "w4a8": {**{m: _INT8 for m in MATRICES if m != "kv_b"}, "routed_experts": _INT4},
}
# msModelSlim's config.json values for each integer --weights: (quantize, moe_quantize)
MSMODELSLIM = {"w8a8": ("w8a8_dynamic", None), "w4a8": ("w8a8_dynamic", "w4a8_dynamic")}


def cases_arg(text: str, max_length: int = MAX_LENGTH) -> list[tuple[int, int]]:
    """--decode / --prefill: "1x512,192x512" -> [(1, 512), (192, 512)] (batch x context, or x prompt
    length); "none" -> no case of that kind."""
    if text.strip().lower() == "none":
        return []
    cases = []
    for item in text.split(","):
        b, x, n = item.strip().lower().partition("x")
        if not (x and b.isdigit() and n.isdigit()):
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not BATCHxLENGTH (e.g. 32x512)")
        b, n = int(b), int(n)
        if not (1 <= b <= MAX_BATCH and 1 <= n <= max_length):
            raise argparse.ArgumentTypeError(f"{item.strip()}: batch must be 1..{MAX_BATCH} and length "
                                             f"1..{max_length}")
        cases.append((b, n))
    return cases


def prefill_cases_arg(text: str) -> list[tuple[int, int]]:
    """--prefill: cases_arg with prompts up to MAX_PROMPT tokens."""
    return cases_arg(text, MAX_PROMPT)


def max_seq_len_for(prefill_cases) -> int:
    """The bench engine's max_seq_len: MAX_LENGTH, or the longest prefill case's prompt."""
    return max([MAX_LENGTH, *(n for _, n in prefill_cases)])


def bench_cases(args) -> tuple[list, list]:
    """(decode cases, prefill cases): --decode / --prefill where given, else --quick's or the full set."""
    from .errors import InputError
    decode_cases, prefill_cases = ([(1, 512), (32, 512)], [(32, 512)]) if args.quick else (DECODE_CASES, PREFILL_CASES)
    if args.decode is not None:
        decode_cases = args.decode
    if args.prefill is not None:
        prefill_cases = args.prefill
    if not decode_cases and not prefill_cases:
        raise InputError("nothing to bench: --decode none and --prefill none")
    return list(decode_cases), list(prefill_cases)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", default=None, help="default: model_specs/deepseek_v2_lite.yaml")
    p.add_argument("--json", default="bench.json", metavar="FILE", help="where to write every number")
    p.add_argument("--iters", type=whole_number(1), default=50,
                   help="timed repetitions per case (the median counts: b=1 steps drift between levels ~4%% apart)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers side")
    p.add_argument("--weights", choices=WEIGHTS, default="bf16",
                   help="the engine's weights: bf16; fp8 (DeepSeek-V3's FP8 blocks for every decoder linear, "
                        "kv_b and the experts); w8a8 / w4a8 (msModelSlim: int8 per-channel decoder linears, the "
                        "routed experts int8 or packed int4; kv_b, router, embedding, lm_head float).  Not bf16: "
                        "the transformers side is skipped")
    p.add_argument("--quick", action="store_true", help="fewer cases (batch 1 and 32, context 512)")
    p.add_argument("--decode", type=cases_arg, default=None, metavar="BxC,...",
                   help="decode cases, batch x context (e.g. 1x512,192x512; none: no decode case)")
    p.add_argument("--prefill", type=prefill_cases_arg, default=None, metavar="BxL,...",
                   help=f"prefill cases, batch x prompt length up to {MAX_PROMPT} (e.g. 1x2048; none: no prefill case)")
    p.add_argument("--block-size", type=block_size_arg, default=DEFAULTS.block_size,
                   help="KV-cache page size in tokens")
    p.add_argument("--max-num-batched-tokens", type=whole_number(1), default=None, metavar="N",
                   help="prefill cases run in steps of at most N tokens, each chunk attending to the rows the "
                        "earlier ones cached, as the engine runs a longer prompt (default: one step a case)")
    p.add_argument("--no-pdl", action="store_true",
                   help="launch every kernel without programmatic dependent launch (an A/B against the default)")
    add_tune_arg(p)


# Seconds of untimed steps before a case is timed, on top of its warm-up calls: the GPU's clocks
# follow its load, and a case timed right after a heavy one or after idle time otherwise reads
# them still moving (H200: the SM clock at 1560 MHz right after the prefill cases, 1980 steady;
# b=1 decode then 2.05 ms against 2.00).
WARM_SECONDS = 0.5


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy (read + write counted), 2 GiB buffers."""
    import torch
    n = 2 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _timeit(lambda: y.copy_(x), 10)
    del x, y
    return 2 * n / (ms / 1e3)


def matrix_bytes(rows: int, cols: int, elt: int = 2, weights: str | None = "bf16") -> int:
    """Bytes a kernel reads of one [rows, cols] weight stored in format `weights` (an ir/formats.py name;
    "fp8" for DeepSeek-V3's; None or an unscaled name: `elt` bytes an element).  FP8: one byte an element
    and a float32 scale per 128 x 128 block, the edge blocks partial.  msModelSlim's integer formats: the
    stored bytes (int8 one an element, packed int4 two elements a byte along the rows) and the float32
    scale per output row (per group: and one per row per group); their `_offset`s are zeros no kernel reads."""
    from ir.formats import FORMATS, FP8, cdiv, scale_shape
    fmt = FP8 if weights == "fp8" else FORMATS.get(weights) if weights else None
    if weights and fmt is None:
        raise ValueError(f"unknown weight format {weights!r} (known: fp8, {', '.join(FORMATS)})")
    if fmt is None or not fmt.quantized:
        return rows * cols * elt
    if fmt.block is not None:
        sr, sc = scale_shape((rows, cols), fmt)
        return rows * cols + 4 * sr * sc
    groups = cdiv(cols, fmt.group) if fmt.group else 0
    return cdiv(rows, fmt.pack) * cols + 4 * rows * (1 + groups)


def layout_of(weights) -> dict:
    """{matrix: format name} for `weights`: a --weights name (LAYOUTS) or such a dict (weight_layout)."""
    return LAYOUTS[weights] if isinstance(weights, str) else weights


def _matrix_names(spec) -> dict:
    """{matrix: the bound name of its first instance} for the MATRICES `spec` (an ir Spec) has."""
    plan, layers = spec.plan, spec.dims["layers"]
    moe = next((i for i in range(layers) if plan.kind(i)[0] == "moe"), None)
    dense = next((i for i in range(layers) if plan.kind(i)[0] == "dense"), None)
    attn = "model.layers.0.self_attn."
    names = {"q": attn + ("q_a_proj.weight" if spec.dims.get("q_lora_rank") else "q_proj.weight"),
             "kv_a": attn + "kv_a_proj_with_mqa.weight", "kv_b": attn + "kv_b_proj.weight", "o": attn + "o_proj.weight",
             "dense_ffn": dense is not None and f"model.layers.{dense}.mlp.gate_proj.weight",
             "shared_experts": moe is not None and f"model.layers.{moe}.mlp.shared_experts.gate_proj.weight",
             "routed_experts": moe is not None and f"model.layers.{moe}.mlp.experts.*.gate_proj.weight"}
    return {m: n for m, n in names.items() if n}


def weight_layout(spec) -> dict:
    """{matrix (MATRICES): format name} as `spec` (an ir Spec) stores them: each matrix's first layer of
    its kind matched against the spec's weight_formats as the graph builder matches them (first glob
    wins; "act", or none: the activation dtype, left out)."""
    import fnmatch

    from ir.formats import ACT
    out = {}
    for matrix, name in _matrix_names(spec).items():
        fmt = next((f for g, f in spec.weight_formats if fnmatch.fnmatchcase(name, g)), ACT)
        if fmt != ACT:
            out[matrix] = fmt
    return out


def layout_in(spec, weights: str) -> dict:
    """LAYOUTS[weights] over the matrices `spec` has (a spec without dense layers has no dense_ffn)."""
    have = _matrix_names(spec)
    return {m: f for m, f in LAYOUTS[weights].items() if m in have}


def decode_bytes(dims: dict, first_dense: int, batch: int, ctx: int, elt: int = 2, weights="bf16") -> dict:
    """Bytes one decode step must read: touched weights (expected distinct experts) and the cache.
    `weights`: a --weights name or a weight_layout: each matrix as its format stores it (matrix_bytes;
    "fp8": the decoder linears, kv_b and the experts as FP8 blocks; "w4a8": the routed experts packed
    int4, the other linears int8, kv_b in `elt`); the router (float32), lm_head and cache stay as they are."""
    D, H, C, R, N, V = (dims[k] for k in ("hidden", "heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                          "v_head_dim"))
    E, K, M, I, L = dims["experts"], dims["top_k"], dims["moe_intermediate"], dims["intermediate"], dims["layers"]
    Q, S = dims["q_lora_rank"], dims["shared_experts"]
    layout = layout_of(weights)

    def mat(matrix, rows, cols):
        return matrix_bytes(rows, cols, elt, layout.get(matrix))
    q = mat("q", H * (N + R), D) if not Q else mat("q", Q, D) + mat("q", H * (N + R), Q)
    attn = (q + mat("kv_a", C + R, D) + mat("kv_b", H * (N + V), C) + mat("o", D, H * V)) * L
    dense = (2 * mat("dense_ffn", I, D) + mat("dense_ffn", D, I)) * first_dense
    touched = E * (1 - (1 - K / E) ** batch)
    moe_layers = L - first_dense
    experts = touched * (2 * mat("routed_experts", M, D) + mat("routed_experts", D, M)) * moe_layers
    shared = (2 * mat("shared_experts", M * S, D) + mat("shared_experts", D, M * S)) * moe_layers if S else 0
    router = E * D * 4 * moe_layers
    head = dims["vocab"] * D * elt
    cache = batch * ctx * (C + R) * elt * L
    parts = {"attention": attn, "dense_ffn": dense, "routed_experts": experts, "shared_experts": shared,
             "router": router, "lm_head": head, "cache": cache}
    parts["total"] = sum(parts.values())
    return parts


def linear_bytes(dims: dict, first_dense: int, elt: int = 2, shared: bool = True, weights="bf16") -> int:
    """Weight bytes the step's `linear` / `multi_linear` / `gate_up_silu` ops read (the skinny kernel
    or cuBLAS), whatever the batch: per layer the q (or q_a + q_b), kv_a and o projections, the
    dense FFN or (`shared`: unless they run in the expert kernels) the shared experts, and the head.
    kv_b is not among them in decode (the absorbed query and v_up kernels read it).  `weights` (a --weights
    name or a weight_layout): as matrix_bytes stores them (the head stays in `elt`)."""
    D, H, C, R, N, V = (dims[k] for k in ("hidden", "heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                          "v_head_dim"))
    L, Q, M, I, S = dims["layers"], dims["q_lora_rank"], dims["moe_intermediate"], dims["intermediate"], \
        dims["shared_experts"]
    layout = layout_of(weights)

    def mat(matrix, rows, cols):
        return matrix_bytes(rows, cols, elt, layout.get(matrix))
    q = mat("q", H * (N + R), D) if not Q else mat("q", Q, D) + mat("q", H * (N + R), Q)
    attn = (q + mat("kv_a", C + R, D) + mat("o", D, H * V)) * L
    ffn = (2 * mat("dense_ffn", I, D) + mat("dense_ffn", D, I)) * first_dense
    if shared and S:
        ffn += (2 * mat("shared_experts", M * S, D) + mat("shared_experts", D, M * S)) * (L - first_dense)
    return attn + ffn + dims["vocab"] * D * elt


def _token_ids(vocab: int, shape: tuple, *case) -> "torch.Tensor":
    """Random token ids (on the CPU) drawn from a generator seeded by the case, so that every run of
    a tree, and both arms of an A/B, route the same tokens to the same experts: the touched experts
    (the step's bytes and floor) moved by up to 2.4% between runs of one tree with unseeded ids
    (docs/PERF_NOTES.md)."""
    import torch
    seed = 0
    for v in (*case, *shape):
        seed = seed * 1_000_003 + int(v)
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed % (1 << 63)))


def decode_engine(cases, pdl: bool = True):
    """DeepSeek-V2-Lite with random bf16 weights on the GPU, whose cache holds every (batch, ctx) of
    `cases` at once plus 64 blocks: the engine of the GPU timing scripts (bench/perf_*.py)."""
    from codegen.paths import DEFAULT_SPEC

    from .engine import Engine
    bs = DEFAULTS.block_size
    return Engine.from_spec(str(DEFAULT_SPEC), backend="cuda", device="cuda", dtype="bf16", block_size=bs,
                            num_blocks=sum(math.ceil(c / bs) * b for b, c in cases) + 64,
                            max_seq_len=MAX_LENGTH, max_num_seqs=MAX_BATCH, pdl=pdl)


def _decode_ctx(engine, batch: int, ctx: int):
    """A decode StepContext for `batch` sequences that each already hold `ctx - 1` cached tokens,
    and random token ids.  Made as the engine makes a decode step's (Engine._step_tensors): where
    the backend replays decode graphs, on the graph's own input buffers, written once here, so a
    timed forward queues no copies before its replay, as the engine's step queues none."""
    import torch

    from ir.context import StepContext
    seq_ids = [10_000_000 + b for b in range(batch)]   # ids no real request uses
    slots = []
    for sid in seq_ids:
        engine.tables.reserve(sid, ctx)
        slots.extend(engine.tables.slot_mapping(sid, ctx - 1, ctx))
    tokens = _token_ids(engine.vocab, (batch,), ctx).tolist()
    ids, positions, slots, _, tables = engine._step_tensors("decode", seq_ids, tokens, [ctx - 1] * batch, slots,
                                                             None)
    step = StepContext(positions=positions, query_lens=[1] * batch, context_lens=[ctx] * batch,
                       block_tables=tables, slot_mapping=slots, kv_cache=engine.cache.layers,
                       block_size=engine.block_size)
    return seq_ids, step, ids


def _prefill_ctx(engine, batch: int, length: int):
    """(sequence ids, the step, its token ids) of one unchunked prefill of `batch` prompts."""
    seq_ids, ((step, ids),) = _prefill_steps(engine, batch, length, None)
    return seq_ids, step, ids


def _prefill_steps(engine, batch: int, length: int, cap: int | None):
    """(sequence ids, [(step, token ids)]): `batch` prompts of `length` tokens prefilled as the engine
    runs them under max_num_batched_tokens = `cap` (scheduler.chunk_tokens: at most `cap` tokens a
    step, the prompts in order, each chunk over the rows the earlier ones cached); one step where
    `cap` is None.  Each step keeps the logits of its sequences' last rows, as generate does."""
    import torch

    from ir.context import StepContext

    from .scheduler import chunk_tokens
    seq_ids = [20_000_000 + b for b in range(batch)]   # ids no real request uses
    for sid in seq_ids:
        engine.tables.reserve(sid, length)
    dev = engine.device
    ids_all = _token_ids(engine.vocab, (batch * length,), length).to(dev)
    cached, steps = [0] * batch, []
    while any(c < length for c in cached):
        take = chunk_tokens([length - c for c in cached], cap if cap is not None else batch * length)
        run = [b for b in range(batch) if take[b]]
        slots, positions, ids = [], [], []
        for b in run:
            slots.extend(engine.tables.slot_mapping(seq_ids[b], cached[b], cached[b] + take[b]))
            positions.append(torch.arange(cached[b], cached[b] + take[b], device=dev))
            ids.append(ids_all[b * length + cached[b]:b * length + cached[b] + take[b]])
        query_lens = [take[b] for b in run]
        step = StepContext(positions=torch.cat(positions), query_lens=query_lens,
                           context_lens=[cached[b] + take[b] for b in run],
                           block_tables=engine.tables.table_tensor([seq_ids[b] for b in run], dev),
                           slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                           kv_cache=engine.cache.layers, block_size=engine.block_size,
                           logit_rows=torch.tensor(query_lens, device=dev).cumsum(0) - 1)
        steps.append((step, torch.cat(ids)))
        for b in run:
            cached[b] += take[b]
    return seq_ids, steps


def _run_steps(backend, phase: str, steps):
    """A callable that runs `steps` ([(step, ids)]) in order: one timed prefill, chunked or not."""
    if len(steps) == 1:
        ((step, ids),) = steps
        return lambda: backend.forward(phase, ids, step)
    return lambda: [backend.forward(phase, ids, step) for step, ids in steps]


_GENERATED = re.compile(r"^([a-z][a-z0-9_]*?)__")


def family_of(kernel: str) -> str:
    """A generated kernel's family (its name is family__parts: codegen.render.kernel_name); any
    other kernel is the libraries' (cuBLAS, its split-K reduce, torch)."""
    m = _GENERATED.match(kernel)
    return m.group(1) if m else "cublas/torch"


def _breakdown(step_fn) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    # twice: a prefill shape runs eagerly the first time it is seen and is captured the second
    # (cuda_graphs.PrefillGraphs), whose warm-up would put a second step's kernels in the trace
    for _ in range(2):
        step_fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step_fn()
        torch.cuda.synchronize()
    families: dict[str, dict] = {}
    total, launches = 0.0, 0
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if us <= 0 or ev.key.startswith(("Memcpy", "Memset", "cudaGraph")):
            continue
        family = family_of(ev.key)
        f = families.setdefault(family, {"launches": 0, "ms": 0.0})
        f["launches"] += ev.count
        f["ms"] += us / 1e3
        total += us / 1e3
        launches += ev.count
    return {"launches": launches, "kernel_ms": total,
            "families": dict(sorted(families.items(), key=lambda kv: -kv[1]["ms"]))}


def _device_breakdown(backend, step_fn, pdl: bool) -> dict:
    """_breakdown of a decode step with every kernel launched plain: with programmatic dependent
    launch a kernel starts during its predecessor's tail and the profiler counts its wait in its
    duration, so per-family rates (bytes over a family's time) need each kernel's own device time.
    The step's graphs are captured anew for it and dropped after (the next case captures its own).
    Where PDL is off already, the breakdown is that."""
    if not pdl:
        return _breakdown(step_fn)
    runner, graphs = backend.runner, backend.graphs_decode.graphs
    graphs.clear()
    runner.pdl = False
    try:
        return _breakdown(step_fn)
    finally:
        runner.pdl = True
        graphs.clear()


def pdl_edges(plan, sizes: dict) -> dict:
    """How a step's launches follow one another (from the plan, no GPU): kernels launched (a grid
    with a 0 dim is not), how many are programmatic dependent launches, and how many of those
    follow a PDL kernel directly, the boundaries where a kernel can start during the previous
    one's tail (that kernel calls launch_dependents; a library kernel or a kernel launched without
    the attribute in front serialises as before).  A split is a view: nothing is launched; nor is a
    library call below its from_tokens (a linear's kernels serve those T: cuda_backend._forward)."""
    from codegen import sizes as size_exprs
    from codegen.kernel import KernelLaunch
    kernels = pdl = overlapped = 0
    prev = None
    for step in plan.steps:
        if isinstance(step, KernelLaunch):
            if 0 in (size_exprs.evaluate(g, sizes) for g in step.grid):
                continue
            kernels += 1
            pdl += step.pdl
            overlapped += step.pdl and prev == "pdl"
            prev = "pdl" if step.pdl else "kernel"
        elif step.op != "split" and step.runs_at(sizes["T"]):
            prev = "library"
    return {"kernels": kernels, "pdl": pdl, "overlapped": overlapped}


ROUTED_EXPERT_FAMILIES = ("moe_gate_up_silu", "moe_down", "moe_expert_ffn")   # the last: decode, both in one
LIBRARY_FAMILY = "cublas/torch"
SKINNY_FAMILY = "linear_skinny"
LINEAR_FAMILIES = (SKINNY_FAMILY, LIBRARY_FAMILY)


def linear_rate(row: dict) -> dict | None:
    """The linears of one decode step: the skinny kernel's family (steps of at most
    SKINNY_MAX_TOKENS tokens) plus the library kernels (cuBLAS and its split-K reduce above that;
    torch's few other kernels count here too), their device ms and the weight bytes the linears
    read (row["linear_bytes"]) per second, from the PDL-free profile where the row has one
    (_device_breakdown); per family as well, each family's rate over the bytes it
    read: all of them for the family that serves the step's T, none for the other.  None without a
    breakdown."""
    from codegen.families.linear_skinny import SKINNY_MAX_TOKENS
    fams = (row.get("device_breakdown") or row.get("breakdown") or {}).get("families", {})
    parts = {f: fams[f]["ms"] for f in LINEAR_FAMILIES if fams.get(f, {}).get("ms")}
    if not parts or not row.get("linear_bytes"):
        return None
    ms = sum(parts.values())
    serving = SKINNY_FAMILY if row.get("batch", SKINNY_MAX_TOKENS + 1) <= SKINNY_MAX_TOKENS else LIBRARY_FAMILY
    per = {f: {"ms": v, "bytes_per_s": row["linear_bytes"] / (v / 1e3) if f == serving else None}
           for f, v in parts.items()}
    return {"ms": ms, "bytes_per_s": row["linear_bytes"] / (ms / 1e3), "families": per}


def mla_decode_times(row: dict) -> dict | None:
    """The MLA decode kernels of one decode step, a launch each a layer: the attention's own device
    microseconds a layer and the cache it reads per second (decode_bytes' cache), and the absorbed
    query's and v_up's microseconds a layer (issue 14's targets are per layer), from the PDL-free
    profile where the row has one; None without the attention in it."""
    fams = (row.get("device_breakdown") or row.get("breakdown") or {}).get("families", {})
    att = fams.get("mla_decode_attention")
    if not att or not att.get("launches"):
        return None

    def us(f):
        x = fams.get(f)
        return x["ms"] * 1e3 / x["launches"] if x and x.get("launches") else None
    return {"attention_us": us("mla_decode_attention"), "query_us": us("mla_decode_query"), "v_up_us": us("mla_v_up"),
            "cache_bytes_per_s": row["bytes"]["cache"] / (att["ms"] / 1e3)}


def routed_expert_rate(row: dict) -> dict | None:
    """The grouped expert kernels of one decode step: their own device ms (the PDL-free profile,
    _device_breakdown, where the row has one) and the expert weights they read per second: the
    touched routed experts (decode_bytes' routed_experts), and the shared experts' too where they
    run in the same launches (row["shared_in_experts"]: ir/passes/fuse_shared_experts.py); None
    without a breakdown."""
    fams = (row.get("device_breakdown") or row.get("breakdown") or {}).get("families", {})
    ms = sum(fams[f]["ms"] for f in ROUTED_EXPERT_FAMILIES if f in fams)
    if not ms:
        return None
    read = row["bytes"]["routed_experts"] + (row["bytes"]["shared_experts"] if row.get("shared_in_experts") else 0)
    return {"ms": ms, "bytes_per_s": read / (ms / 1e3), "bytes": read}


def expert_gemm_flops(dims: dict, first_dense: int, tokens: int, pairs_per_token: int | None = None) -> dict:
    """FLOPs of one prefill step's grouped expert GEMMs per family: every token's pairs (top_k,
    or `pairs_per_token` where the shared experts are pairs too) through gate + up (2 x
    moe_intermediate rows of hidden) and down, in every MoE layer."""
    D, M, K = dims["hidden"], dims["moe_intermediate"], pairs_per_token or dims["top_k"]
    pairs = tokens * K * (dims["layers"] - first_dense)
    return {"moe_gate_up_silu": pairs * 2 * (2 * M) * D, "moe_down": pairs * 2 * D * M}


def expert_gemm_rate(row: dict) -> dict | None:
    """The routed-expert GEMMs of one prefill step: per family its device ms and FLOP/s over
    row["expert_flops"] (issue 11's figure: >= 550 TFLOP/s at 32x512); None without a breakdown."""
    fams = (row.get("breakdown") or {}).get("families", {})
    per = {f: {"ms": fams[f]["ms"], "flops_per_s": flops / (fams[f]["ms"] / 1e3)}
           for f, flops in (row.get("expert_flops") or {}).items() if fams.get(f, {}).get("ms")}
    return per or None


# A transformers eager step's memory beside its weights (an estimate, on the high side): per token
# the hidden states, q, the decompressed k / v, and the dense FFN's intermediates (bf16, with some
# held at once), the attention's scores per head (fp32 softmax and its bf16 copy), the decode
# cases' DynamicCache (decompressed K and V, every layer), and cuBLAS workspaces and slack.
HF_SLACK_BYTES = 3 << 30


def hf_activation_bytes(dims: dict, prefill_cases, decode_cases) -> int:
    D, H, I, L = dims["hidden"], dims["heads"], dims["intermediate"], dims["layers"]
    NR, V = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"], dims["v_head_dim"]
    prefill = max((b * n * 2 * (8 * D + 3 * I + 4 * H * NR) + b * H * n * n * 6 for b, n in prefill_cases), default=0)
    decode = max((b * c * H * (NR + V) * L * 2 for b, c in decode_cases), default=0)
    return max(prefill, decode) + HF_SLACK_BYTES


def transformers_placement(free: int, reclaimable: int, need: int) -> tuple[str, str]:
    """Where the transformers side runs, from the GPU's measured free memory with the engine loaded
    (`free`: runtime.memory.available_bytes), what freeing the engine's KV cache, graphs and arenas
    gives back (`reclaimable`) and what the transformers model needs (`need`: its weights and
    hf_activation_bytes): ("beside", ...) the engine, ("after_cache", ...) once those are freed, or
    ("skip", the one line that says why)."""
    gb = 1e9
    if need <= free:
        return "beside", f"transformers beside the engine ({need / gb:.1f} GB of {free / gb:.1f} GB free)"
    if need <= free + reclaimable:
        return "after_cache", (f"transformers after the engine's KV cache and graphs are freed ({need / gb:.1f} GB "
                               f"needed, {free / gb:.1f} GB free, {reclaimable / gb:.1f} GB freed)")
    return "skip", (f"transformers skipped: it needs {need / gb:.1f} GB and the GPU has {free / gb:.1f} GB free even "
                    f"with the engine's KV cache and graphs freed ({reclaimable / gb:.1f} GB more); --no-transformers "
                    f"says so up front")


def _engine_reclaimable(engine) -> int:
    """What freeing the engine's KV cache, captured graphs and arenas gives back: the cache and arenas
    exactly, the graphs' pool as torch's allocator holds it beyond the weights, cache and arenas."""
    import torch
    cache = engine.cache.nbytes
    arenas = engine.backend.arena_bytes()
    weights = sum(t.numel() * t.element_size() for t in engine.backend.weights.values() if t is not None)
    pools = max(0, torch.cuda.memory_reserved() - weights - cache - arenas)
    return cache + arenas + pools


def free_engine_memory(engine) -> None:
    """Free the engine's KV cache, captured graphs and arenas (the weights stay); restore_engine_cache
    makes a cache of the same size again."""
    import torch
    backend = engine.backend
    backend.graphs_decode.graphs.clear()
    backend.graphs_prefill.graphs.clear()
    backend.release_arenas()
    engine.cache.layers.clear()
    torch.cuda.empty_cache()


def restore_engine_cache(engine) -> None:
    from .kv_cache import PagedLatentCache
    c, dims = engine.cache, engine.spec.dims
    engine.cache = PagedLatentCache(dims["layers"], c.num_blocks, c.block_size, c.width, engine.dtype, engine.device)


def _release(engine, seq_ids):
    for s in seq_ids:
        engine.tables.release(s)


def check_json_path(path: str) -> None:
    """InputError unless the bench can write its JSON at `path` (--json): checked before anything
    runs, not found out after the whole benchmark."""
    from pathlib import Path

    from .errors import InputError
    out = Path(path)
    folder = out.parent
    if out.is_dir():
        raise InputError(f"--json {path} is a folder; give a file name (e.g. {out / 'bench.json'})")
    if not folder.is_dir():
        why = "is a file" if folder.exists() else "does not exist"
        raise InputError(f"--json {path}: its folder {folder} {why}")
    if not os.access(out if out.exists() else folder, os.W_OK):
        raise InputError(f"--json {path}: {'the file' if out.exists() else f'its folder {folder}'} is not writable")


def run_bench(args) -> int:
    """benchmark DeepSeek-V2-Lite decode/prefill against the roofline and transformers"""
    from .errors import InputError, require_runtime
    # What the options ask for first: a bad one is an error here, on any machine, before a GPU is looked for.
    decode_cases, prefill_cases = bench_cases(args)
    tuning_of(args)
    check_json_path(args.json)
    spec = checked_bench_spec(args)
    check_cases_fit(spec, decode_cases, prefill_cases)
    require_runtime("bench")
    import torch

    if not torch.cuda.is_available():
        raise InputError("dsgraph bench needs a CUDA GPU")
    try:
        return _run_bench(args, spec, decode_cases, prefill_cases)
    except torch.OutOfMemoryError:
        # The default cases fit an 80 GB H100 (V2-Lite's 31 GB of weights, its cache, the planned
        # activations); a smaller GPU or larger cases may not.  Say so, not torch's allocator report.
        gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        raise InputError(f"dsgraph bench ran out of GPU memory ({gib:.0f} GiB on this GPU): these cases need a "
                         f"larger one; --quick, --prefill none or fewer --decode cases need less") from None


def transformers_skipped(weights: str) -> str:
    """The one line that says why the transformers side does not run under --weights `weights` (not bf16)."""
    return (f"transformers skipped: --weights {weights} (transformers would run the weights dequantised to bf16, "
            f"another model's bytes; `dsgraph bench` without --weights {weights} compares the two in bf16)")


TRANSFORMERS_FP8 = transformers_skipped("fp8")
WEIGHTS_TITLE = {"fp8": "FP8 weights (V3's blocks)",
                 "w8a8": "W8A8 weights (msModelSlim: int8 per-channel linears and experts)",
                 "w4a8": "W4A8 weights (msModelSlim: packed int4 routed experts, int8 per-channel linears)"}


def bench_spec(spec_path: str, weights: str):
    """The spec the bench compiles: `spec_path` as it is (bf16); with DeepSeek-V3's FP8 weight_formats
    (runtime/convert.py spec_in_format: what Engine.from_pretrained(weight_format="fp8") applies); or with
    msModelSlim's (w8a8 / w4a8: the weight_formats `spec --from-config` writes for its quantize /
    moe_quantize).  Engine.from_spec draws the random weights and quantises them to that layout.  A spec
    that declares weight_formats itself is taken as it is where they are the layout `weights` names, else
    one InputError."""
    if weights == "bf16":
        return spec_path
    from codegen.paths import spec_path as find_spec
    from ir.spec import load_spec

    from .convert import spec_in_format
    from .errors import InputError
    if weights not in WEIGHTS:
        raise InputError(f"--weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    spec = load_spec(str(find_spec(spec_path)))
    if spec.weight_formats:
        if weight_layout(spec) != layout_in(spec, weights):
            raise InputError(f"spec {spec.file} declares its weights' storage, not --weights {weights}'s: "
                             f"{declared_weights(spec)}")
        return spec
    if weights == "fp8":
        return spec_in_format(spec, None, weights)
    from ir.config_to_spec import msmodelslim_weight_formats
    has_moe = any(spec.plan.kind(i)[0] == "moe" for i in range(spec.dims["layers"]))
    return load_spec(spec.text + msmodelslim_weight_formats(*MSMODELSLIM[weights], has_moe), file=spec.file)


def declared_weights(spec) -> str:
    """What to do with a spec whose weight_formats some --weights did not ask for (the end of a one-line
    error): run it under the --weights whose layout they are, or (none is) bench it without them."""
    layout = weight_layout(spec)
    name = next((w for w in LAYOUTS if layout_in(spec, w) == layout), None)
    if name is not None:
        return f"its weight_formats are --weights {name}'s layout; run it with --weights {name}"
    return (f"its weight_formats ({', '.join(f'{m} {f}' for m, f in layout.items())}) are none of --weights "
            f"{', '.join(WEIGHTS)}; bench the spec without them, under --weights")


def checked_bench_spec(args):
    """The spec `dsgraph bench` runs (bench_spec of --spec and --weights), checked on any machine before a
    GPU is looked for: a spec whose weight_formats are not --weights' is one line, and (not bf16) the spec
    is lowered for the cuda backend, so a shape the quantised kernels cannot serve is the lowering's one
    line rather than a failure after the weights are on the GPU."""
    from codegen.kernel import Options
    from codegen.lower import lower_graph, pipeline_knobs
    from codegen.paths import DEFAULT_SPEC
    from codegen.paths import spec_path as find_spec
    from ir.graph import build_graph
    from ir.passes import run_pipeline
    from ir.spec import load_spec

    from .errors import InputError
    spec_arg = args.spec or str(DEFAULT_SPEC)
    spec = bench_spec(spec_arg, args.weights)
    if args.weights == "bf16":
        declared = load_spec(str(find_spec(spec_arg)))
        if declared.weight_formats:
            raise InputError(f"spec {declared.file} stores weights quantised, not in bf16: "
                             f"{declared_weights(declared)}")
        return spec_arg
    opts = Options(arch="sm_90a", dtype="bf16", block_size=args.block_size, pdl=not args.no_pdl,
                   tuning=tuning_of(args))
    for phase in ("prefill", "decode"):
        lower_graph(run_pipeline(build_graph(spec, phase), knobs=pipeline_knobs(opts)), opts)
    return spec


def max_positions_of(spec) -> int:
    """The spec's max_positions (`spec`: checked_bench_spec's, a path or shipped name, or a Spec)."""
    from codegen.paths import spec_path as find_spec
    from ir.spec import load_spec
    return (load_spec(str(find_spec(spec))) if isinstance(spec, str) else spec).dims["max_positions"]


def check_cases_fit(spec, decode_cases, prefill_cases) -> None:
    """Every case's sequence within the spec's max_positions, or one InputError naming those past it."""
    from .errors import InputError
    limit = max_positions_of(spec)
    longer = [f"{b}x{n}" for b, n in decode_cases + prefill_cases if n > limit]
    if longer:
        raise InputError(f"bench cases {', '.join(longer)} are longer than the spec's max_positions={limit}: "
                         f"give --decode / --prefill cases within it")


def bench_num_blocks(decode_cases, prefill_cases, block_size: int) -> int:
    """The bench engine's cache: the largest case's tokens, plus 8 blocks a decode sequence."""
    max_tokens = max(b * c for b, c in decode_cases + prefill_cases)
    return math.ceil(max_tokens / block_size) + 8 * max((b for b, _ in decode_cases), default=0)


def _run_bench(args, spec, decode_cases, prefill_cases) -> int:
    """`spec`: checked_bench_spec's (a path or a Spec)."""
    import torch

    from .engine import Engine
    from .errors import InputError
    from codegen.paths import DEFAULT_SPEC
    spec_path = args.spec or str(DEFAULT_SPEC)
    result = {"gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
              "versions": {"torch": torch.__version__, "python": platform.python_version()}, "spec": spec_path}
    try:
        from codegen.nvrtc import nvrtc_version
        result["versions"]["nvrtc"] = ".".join(map(str, nvrtc_version()))
    except Exception:  # noqa: BLE001
        pass
    bw = copy_bandwidth()
    result["copy_bandwidth_GBps"] = bw / 1e9
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s", flush=True)

    num_blocks = bench_num_blocks(decode_cases, prefill_cases, args.block_size)
    weights = args.weights
    result["weights"] = weights
    t0 = time.perf_counter()
    engine = Engine.from_spec(spec, backend="cuda", device="cuda", dtype="bf16",
                              block_size=args.block_size,
                              num_blocks=num_blocks,
                              max_seq_len=min(max_seq_len_for(prefill_cases), max_positions_of(spec)),
                              max_num_seqs=MAX_BATCH, pdl=not args.no_pdl, tuning=tuning_of(args))
    result["pdl"] = not args.no_pdl
    result["tuning"] = tuning_of(args).changed()
    result["load_seconds"] = time.perf_counter() - t0
    backend = engine.backend
    dims = engine.spec.dims
    result["layers"] = dims["layers"]
    first_dense = engine.spec.plan.first_k_dense_replace
    layout = weight_layout(engine.spec)    # each matrix's storage, as the compiled spec declares it
    result["weight_layout"] = layout

    with torch.inference_mode():
        # Every step is timed before the first profile: once torch's profiler has run, CUPTI stays
        # attached to the process and adds host time to every later launch (a decode graph's
        # replay call on the H200: 29-52 us before, 128-275 after), which a step's
        # wall clock then counts.  So: all the timings, then all the profiles.
        timed = {}
        cap = args.max_num_batched_tokens
        for batch, length in prefill_cases:
            seq_ids, steps = _prefill_steps(engine, batch, length, cap)
            run = _run_steps(backend, "prefill", steps)
            # the case's own activation peak: its arena made anew at its size, beside what else a step allocates
            backend.release_arenas()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            # The warm-up's second step captures the shape's graph where it has one (cuda_graphs.PrefillGraphs);
            # the same shape launched eagerly, as a shape's first step runs, is timed beside it.
            ms = _timeit(run, max(3, args.iters // 3), warmup=2, warm_s=WARM_SECONDS)
            graphs, backend.use_graphs = backend.use_graphs, False
            try:
                eager_ms = _timeit(run, max(3, args.iters // 3), warmup=1)
            finally:
                backend.use_graphs = graphs
            torch.cuda.synchronize()
            timed["prefill", batch, length] = ms, eager_ms, torch.cuda.max_memory_allocated() - before
            _release(engine, seq_ids)
            chunks = f" in {len(steps)} steps of <= {cap} tokens" if len(steps) > 1 else ""
            print(f"prefill {batch}x{length}{chunks}: {ms:.1f} ms, {batch * length / (ms / 1e3):.0f} tok/s "
                  f"(eager {eager_ms:.1f} ms, {batch * length / (eager_ms / 1e3):.0f} tok/s)", flush=True)
        for batch, ctx in decode_cases:
            seq_ids, step, ids = _decode_ctx(engine, batch, ctx)
            timed["decode", batch, ctx] = ms = _timeit(lambda: backend.forward("decode", ids, step), args.iters,
                                                        warm_s=WARM_SECONDS)
            _release(engine, seq_ids)
            need = decode_bytes(dims, first_dense, batch, ctx, weights=layout)
            print(f"decode b={batch} ctx={ctx}: {ms:.2f} ms/step (floor {need['total'] / bw * 1e3:.2f}), "
                  f"{need['total'] / (ms / 1e3) / bw * 100:.0f}% of copy bandwidth", flush=True)

        if not args.no_transformers and weights != "bf16":
            result["transformers_skipped"] = transformers_skipped(weights)
            print(result["transformers_skipped"], flush=True)
        elif not args.no_transformers:   # transformers' eager steps launch thousands of kernels: before the profiles
            result["transformers"] = _transformers_side(engine, args, prefill_cases,
                                                        [c for c in HF_DECODE_CASES if c in decode_cases])

        result["prefill"] = []
        for batch, length in prefill_cases:
            seq_ids, steps = _prefill_steps(engine, batch, length, cap)
            ms, eager_ms, peak = timed["prefill", batch, length]
            row = {"batch": batch, "length": length, "ms": ms, "tokens_per_s": batch * length / (ms / 1e3),
                   "eager_ms": eager_ms, "eager_tokens_per_s": batch * length / (eager_ms / 1e3),
                   "activation_peak_bytes": peak, "max_num_batched_tokens": cap, "steps": len(steps),
                   "breakdown": _breakdown(_run_steps(backend, "prefill", steps)),
                   "expert_flops": expert_gemm_flops(dims, first_dense, batch * length, backend.pairs_per_token)}
            row["expert_gemms"] = expert_gemm_rate(row)
            _release(engine, seq_ids)
            result["prefill"].append(row)

        result["decode"] = []
        for batch, ctx in decode_cases:
            seq_ids, step, ids = _decode_ctx(engine, batch, ctx)
            ms = timed["decode", batch, ctx]
            need = decode_bytes(dims, first_dense, batch, ctx, weights=layout)
            row = {"batch": batch, "context": ctx, "ms": ms, "tokens_per_s": batch / (ms / 1e3),
                   "bytes": need, "floor_ms": need["total"] / bw * 1e3,
                   "fraction_of_bandwidth": need["total"] / (ms / 1e3) / bw,
                   "breakdown": _breakdown(lambda: backend.forward("decode", ids, step)),
                   "device_breakdown": _device_breakdown(backend, lambda: backend.forward("decode", ids, step),
                                                         not args.no_pdl)}
            row["shared_in_experts"] = backend.pairs_per_token > dims["top_k"]
            row["routed_experts"] = routed_expert_rate(row)
            row["linear_bytes"] = linear_bytes(dims, first_dense, shared=not row["shared_in_experts"],
                                              weights=layout)
            row["linears"] = linear_rate(row)
            row["mla_decode"] = mla_decode_times(row)
            sizes = {**backend._sizes(step), "SMS": torch.cuda.get_device_properties(0).multi_processor_count}
            row["pdl_edges"] = pdl_edges(backend.plans["decode"], sizes)
            _release(engine, seq_ids)
            result["decode"].append(row)

        # Per-kernel device time of one step per case comes from the CUPTI trace (graph replay for
        # decode): no launch overhead, no extra syncs.

    _print_table(result)
    try:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    except OSError as e:   # checked at the start; something changed since
        raise InputError(f"cannot write --json {args.json}: {e.strerror or e}") from None
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _transformers_side(engine, args, prefill_cases, decode_cases) -> dict:
    """_bench_transformers where transformers_placement says it fits (freeing the engine's cache first
    where it must, and making it again after); {"skipped": why} where it does not."""
    import torch

    from .memory import available_bytes
    weights = sum(t.numel() * t.element_size() for t in engine.backend.weights.values() if t is not None)
    need = weights + hf_activation_bytes(engine.spec.dims, prefill_cases, decode_cases)
    torch.cuda.synchronize()
    where, why = transformers_placement(available_bytes("cuda"), _engine_reclaimable(engine), need)
    print(why, flush=True)
    if where == "skip":
        return {"skipped": why}
    if where == "after_cache":
        free_engine_memory(engine)
    try:
        out = _bench_transformers(engine, args, prefill_cases, decode_cases)
    except torch.OutOfMemoryError:
        out = None   # the model is freed with the exception's frames, here
    if out is None:
        torch.cuda.empty_cache()
        why = "transformers ran out of GPU memory beside the engine's weights; its numbers are left out"
        print(why, flush=True)
        out = {"skipped": why}
    if where == "after_cache":
        restore_engine_cache(engine)
    out["placement"] = where
    return out


def _bench_transformers(engine, args, prefill_cases, decode_cases) -> dict:
    """The same workloads through transformers eager on the same weights."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache

    from codegen.paths import MODEL_SPECS_DIR
    cfg_path = MODEL_SPECS_DIR / "hf_configs" / "deepseek_v2_lite.json"
    raw = json.loads(cfg_path.read_text())
    cfg = DeepseekV2Config(**{k: v for k, v in raw.items() if not k.startswith("_") and k not in ("architectures",
                                                                                                   "torch_dtype")})
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)   # build in bf16 directly: an fp32 copy would need 63 GB
    try:
        with torch.device("meta"):
            model = DeepseekV2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device="cuda").eval()
    _load_into_transformers(model, engine)
    out = {"prefill": [], "decode": []}
    with torch.inference_mode():
        for batch, length in prefill_cases:
            ids = _token_ids(cfg.vocab_size, (batch, length)).to("cuda")
            # the last position's logits only, as generation needs (and as dsgraph's prefill runs)
            keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
            ms = _timeit(lambda: model(ids, **keep), 2, warmup=1)
            out["prefill"].append({"batch": batch, "length": length, "ms": ms,
                                   "tokens_per_s": batch * length / (ms / 1e3)})
            print(f"transformers prefill {batch}x{length}: {ms:.0f} ms", flush=True)
        for batch, ctx in decode_cases:
            ids = _token_ids(cfg.vocab_size, (batch, ctx - 1)).to("cuda")
            cache = DynamicCache(config=cfg)
            # transformers 5.24 renamed past_key_values to cache.
            kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            model(ids, **{kw: cache}, use_cache=True)
            nxt = _token_ids(cfg.vocab_size, (batch, 1), ctx).to("cuda")
            base = cache.get_seq_length()

            def step():
                cache.crop(base)
                model(nxt, **{kw: cache}, use_cache=True)
            ms = _timeit(step, 3, warmup=1)
            out["decode"].append({"batch": batch, "context": ctx, "ms": ms, "tokens_per_s": batch / (ms / 1e3)})
            print(f"transformers decode b={batch} ctx={ctx}: {ms:.1f} ms/step", flush=True)
    del model
    torch.cuda.empty_cache()
    return out


def _load_into_transformers(model, engine) -> None:
    """Copy dsgraph's weights into a transformers model (it fuses routed experts in memory; our
    expert stacks may hold slices of the shared experts' tensors), one stacked part at a time, as
    the engine's bundle manifest says each weight stacks."""
    import torch

    from .hf_layout import transformers_state, write_transformers
    specs = engine.weight_specs
    state = transformers_state(model)
    with torch.no_grad():
        for name, t in engine.backend.weights.items():
            write_transformers(state, name, specs[name].parts, t)
        # Buffers built on the meta device hold garbage after to_empty: rebuild the rotary tables.
        model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to("cuda")


def _print_table(r: dict) -> None:
    hf = r.get("transformers", {})
    hf_dec = {(d["batch"], d["context"]): d["ms"] for d in hf.get("decode", [])}
    hf_pre = {(d["batch"], d["length"]): d["tokens_per_s"] for d in hf.get("prefill", [])}
    print()
    pdl = {True: ", PDL on", False: ", PDL off (--no-pdl)"}.get(r.get("pdl"), "")
    weights = f", {WEIGHTS_TITLE[r['weights']]}" if r.get("weights") in WEIGHTS_TITLE else ""
    print(f"dsgraph bench — {r['gpu']}, {r['date']}, copy {r['copy_bandwidth_GBps'] / 1e3:.2f} TB/s{pdl}{weights}")
    print(f"{'case':<26}{'dsgraph':>14}{'floor':>10}{'% bw':>7}{'transformers':>15}{'speed-up':>10}")
    for d in r["decode"]:
        key = (d["batch"], d["context"])
        t = hf_dec.get(key)
        print(f"{'decode b=%d ctx=%d' % key:<26}{d['ms']:>11.2f} ms{d['floor_ms']:>7.2f} ms"
              f"{d['fraction_of_bandwidth'] * 100:>6.0f}%" + (f"{t:>12.1f} ms{t / d['ms']:>9.1f}x" if t else ""))
    for p in r["prefill"]:
        key = (p["batch"], p["length"])
        t = hf_pre.get(key)
        print(f"{'prefill %dx%d' % key:<26}{p['tokens_per_s'] / 1e3:>9.1f}k tok/s{'':>17}"
              + (f"{t / 1e3:>9.1f}k tok/s{p['tokens_per_s'] / t:>6.1f}x" if t else f"{'':>23}")
              + (f"   eager {p['eager_tokens_per_s'] / 1e3:.1f}k tok/s" if p.get("eager_tokens_per_s") else "")
              + (f", activations {p['activation_peak_bytes'] / 1e9:.2f} GB" if p.get("activation_peak_bytes") else ""))
    print("\nper-kernel device time of one step (top families, ms):")
    for row in r["decode"] + r["prefill"]:
        br = row.get("breakdown")
        if not br:
            continue
        label = (f"decode b={row['batch']} ctx={row['context']}" if "context" in row
                 else f"prefill {row['batch']}x{row['length']}")
        top = ", ".join(f"{f[:22]} {v['ms']:.2f}" for f, v in list(br["families"].items())[:5])
        per_layer = f" ({br['launches'] / r['layers']:.1f} a layer)" if r.get("layers") else ""
        print(f"  {label:<24}{br['kernel_ms']:>8.2f} in {br['launches']} kernels{per_layer}: {top}")

    def section(key: str, title: str, line) -> None:
        """One block of per-decode-case lines, printed only where some case has `key`."""
        rows = [(d, d.get(key)) for d in r["decode"]]
        if any(x for _, x in rows):
            print(f"\n{title}")
            for d, x in rows:
                if x:
                    print(f"  decode b={d['batch']} ctx={d['context']:<8}" + line(x))

    def linear_line(x: dict) -> str:
        frac = x["bytes_per_s"] / (r["copy_bandwidth_GBps"] * 1e9)
        fams = "; ".join(f"{f} {v['ms']:.2f} ms" + (f" {v['bytes_per_s'] / 1e9:.0f} GB/s" if v.get("bytes_per_s") else "")
                         for f, v in x.get("families", {}).items())
        return f"{x['ms']:>8.2f} ms  {x['bytes_per_s'] / 1e12:5.2f} TB/s  ({frac * 100:.0f}% of copy)" + (f"   {fams}" if fams else "")

    section("pdl_edges", "programmatic dependent launch per decode step (kernels launched; PDL ones; PDL ones right "
                         "after a PDL kernel):",
            lambda x: f"{x['kernels']:>5} kernels  {x['pdl']:>4} PDL  {x['overlapped']:>4} after a PDL kernel")
    section("routed_experts", "grouped experts (gate_up_silu + down, or both as moe_expert_ffn's one launch) per "
                              "decode step, touched expert weights read, "
                              "the shared experts' included where they run there (each kernel's own device time: "
                              "a profile with PDL off):",
            lambda x: f"{x['ms']:>8.2f} ms  {x['bytes_per_s'] / 1e12:5.2f} TB/s")
    section("linears", "linears (the skinny kernel + cuBLAS and its split-K reduce) per decode step, their weights "
                       "read (own device time, PDL off); per family (GB/s over the weights it read):", linear_line)
    def mla_line(x: dict) -> str:
        def us(k):
            return f"{x[k]:6.1f} us" if x.get(k) is not None else "     -   "
        return (f"  attention {us('attention_us')} ({x['cache_bytes_per_s'] / 1e12:.2f} TB/s of cache)   "
                f"query {us('query_us')}   v_up {us('v_up_us')}")

    section("mla_decode", "MLA decode a layer (each kernel's own device time, PDL off; the attention's cache read "
                          "per second):", mla_line)
    rows = [p for p in r["prefill"] if p.get("expert_gemms")]
    if rows:
        print("\ngrouped expert GEMMs per prefill step, the shared experts' pairs included where they run there "
              "(device time, TFLOP/s):")
        for p in rows:
            fams = "; ".join(f"{f} {v['ms']:.2f} ms {v['flops_per_s'] / 1e12:.0f} TFLOP/s"
                             for f, v in p["expert_gemms"].items())
            print(f"  prefill {p['batch']}x{p['length']:<14}{fams}")
