"""Shared helpers for the generated-kernel tests (tests/gpu/test_kernels_<family>.py).

    from harness import (requires_gpu, TOLERANCES, tolerance, poison, tiny_model, tiny_spec,
                         single_op_graph, make_ctx, step_sizes, ctx_dict)

A kernel test builds a one-node graph for the op (`single_op_graph`), lowers it with
its family, runs the op's reference semantics (fp32/fp64 on the CPU) and the kernel
(`runtime.launcher.KernelRunner`) on the same random inputs, and compares within
`TOLERANCES[dtype]`.  Outputs are `poison`ed before a kernel runs, so an element it
never writes fails the comparison.
"""
from __future__ import annotations

import math
import os
import random

import networkx as nx
import pytest
import torch

import ir
from ir.config_to_spec import spec_from_config
from ir.context import StepContext
from ir.graph import add_op, bind_weights
from ir.ops import OPS, Node

# -- markers ---------------------------------------------------------------------

_NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_MARKS = [pytest.mark.gpu, _NO_GPU]   # module level: pytestmark = GPU_MARKS


def requires_gpu(fn):
    """Decorator: mark a test `gpu` and skip it where CUDA is absent."""
    return pytest.mark.gpu(_NO_GPU(fn))


# -- tolerances ------------------------------------------------------------------

# (rtol, atol) per activation dtype, against an fp32/fp64 reference.  bf16 keeps 8
# mantissa bits (~4e-3 relative per rounding); kernels that accumulate in fp32 and
# round once or twice stay well inside these.
TOLERANCES = {
    "fp32": (1e-4, 1e-4),
    "fp16": (2e-2, 2e-2),
    "bf16": (4e-2, 4e-2),
}

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


# Norm-wise relative bound ||kernel - ref|| / ||ref|| per dtype, against a reference that rounds
# where the kernel rounds (its inputs, and the intermediates it stores).  One rounding of the
# output costs ~2^-9 / sqrt(3) relative in bf16 (~1.1e-3 norm-wise), ~1.4e-4 in fp16.  Measured on
# the H200 (2026-12-01, DSGRAPH_STRICT=measure, every family): worst bf16 2.6e-3, fp16 4.7e-4,
# fp32 1.4e-6.  The bounds sit about 2x above that and far enough under 1% that a 1% change to any
# scale, eps or routing weight fails (tests/gpu/test_mutants.py plants such changes to prove it).
STRICT = {"fp32": 2e-5, "fp16": 1.5e-3, "bf16": 5e-3}


def strict_bound(dtype) -> float:
    return STRICT[_NAMES.get(dtype, dtype)]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64 (inf where actual has NaN: unwritten)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.numel() == 0:
        return 0.0
    if torch.isnan(a).any():
        return float("inf")
    den = float(e.norm())
    num = float((a - e).norm())
    return num / den if den > 0 else num


# DSGRAPH_STRICT=measure records the norm-wise errors without failing on them (to calibrate
# STRICT on a new GPU or toolchain); the element-wise check still runs.
MEASURE_ONLY = os.environ.get("DSGRAPH_STRICT", "") == "measure"


def assert_strict(actual: torch.Tensor, expected: torch.Tensor, dtype, msg: str = "") -> float:
    """The norm-wise check (see STRICT); returns the relative error."""
    err = rel_error(actual, expected)
    bound = strict_bound(dtype)
    assert MEASURE_ONLY or err <= bound, (f"{msg + ': ' if msg else ''}norm-wise relative error {err:.3g} > {bound:g} "
                          f"({_NAMES.get(dtype, dtype)})")
    return err


# -- Hypothesis: randomized per run, the seed printed, counts sized by the budget ---------

def _run_seed() -> int:
    env = os.environ.get("DSGRAPH_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


RUN_SEED = _run_seed()          # tests/gpu/conftest.py prints it in the header and on failure
EXAMPLES_SCALE = float(os.environ.get("DSGRAPH_EXAMPLES_SCALE", "1"))


def kernel_settings(n: int, *, filtering: bool = False):
    """Settings of a kernel property test: `n` examples at the default budget (scaled by
    $DSGRAPH_EXAMPLES_SCALE), a fresh random seed each run ($DSGRAPH_TEST_SEED replays one),
    no example database; the fixed regression cases sit beside each test as @example.  `filtering`: the
    test rejects most drawn cases (assume) by design, so Hypothesis's filtering health check is off."""
    from hypothesis import HealthCheck, settings
    return settings(max_examples=max(1, round(n * EXAMPLES_SCALE)), deadline=None, database=None,
                    derandomize=False, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture,
                                           *([HealthCheck.filter_too_much] if filtering else [])])


def kernel_test(n: int, *, filtering: bool = False):
    """Decorator: kernel_settings(n) plus this run's seed (applied over @given)."""
    from hypothesis import seed

    def wrap(fn):
        return seed(RUN_SEED)(kernel_settings(n, filtering=filtering)(fn))
    return wrap


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for "bf16" / torch.bfloat16 / ..."""
    key = _NAMES.get(dtype, dtype)
    return TOLERANCES[key]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, msg: str = "") -> None:
    rtol, atol = tolerance(dtype)
    torch.testing.assert_close(actual.detach().float().cpu(), expected.detach().float().cpu(),
                               rtol=rtol, atol=atol, equal_nan=False, msg=msg or None)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill in place so an element a kernel never writes fails the comparison:
    floats with NaN, integers with a large negative number. Returns t."""
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(max(torch.iinfo(t.dtype).min // 2, -(1 << 30)))
    return t


def shifted(t: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """t itself, or a contiguous copy of it whose data pointer is one element past an aligned
    allocation (so 4-, 8- and 16-byte vector accesses to it are misaligned)."""
    if not shift:
        return t
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


# -- tiny models -------------------------------------------------------------------

# Spec dim name -> Hugging Face config key (overrides may use either).
_HF_KEYS = {
    "hidden": "hidden_size", "heads": "num_attention_heads", "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "intermediate": "intermediate_size", "moe_intermediate": "moe_intermediate_size",
    "experts": "n_routed_experts", "shared_experts": "n_shared_experts", "top_k": "num_experts_per_tok",
    "groups": "n_group", "topk_groups": "topk_group", "vocab": "vocab_size", "layers": "num_hidden_layers",
    "max_positions": "max_position_embeddings",
}


def tiny_config(**overrides) -> dict:
    """A small DeepSeek-V2-like HF config dict (YaRN rope, q_lora off, 2 layers: 1 dense + 1 MoE).

    Overrides take spec dim names (hidden=64, experts=8, ...) or HF keys
    (model_type="deepseek_v3", topk_method="group_limited_greedy", ...)."""
    cfg = {
        "_name_or_path": "tiny", "model_type": "deepseek_v2",
        "hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
        "routed_scaling_factor": 1.0, "vocab_size": 128, "num_hidden_layers": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    }
    for key, value in overrides.items():
        cfg[_HF_KEYS.get(key, key)] = value
    return cfg


def tiny_spec(**overrides) -> ir.Spec:
    """The Spec of `tiny_config(**overrides)` (parsed and checked to build)."""
    text = spec_from_config(tiny_config(**overrides), name="tiny")
    return ir.load_spec(text, file="t.yaml")


def tiny_model(**overrides):
    """The ModelConfig of a tiny spec (see tiny_config for the overrides)."""
    return tiny_spec(**overrides).model


# -- one-op graphs -------------------------------------------------------------------

def _attrs_with_defaults(op: str, attrs: dict, model) -> dict:
    full = {}
    for name, value in attrs.items():
        attr = OPS[op].attrs.get(name)
        if attr is None:
            raise ValueError(f"{op} has no attribute {name!r} (it has: {', '.join(OPS[op].attrs) or 'none'})")
        # Dim attributes may be given as expressions over the model's dims ("experts").
        full[name] = value if value is None else attr.parse(value, model.dims)
    for name, attr in OPS[op].attrs.items():
        if name not in full:
            if attr.required:
                raise ValueError(f"{op} needs attribute {name!r}")
            full[name] = attr.default
    if "eps" in OPS[op].attrs and full.get("eps") is None:
        full["eps"] = model.rms_norm_eps
    return full


def single_op_graph(model_config, op: str, attrs: dict, input_types: dict, weights_templates: dict,
                    layer: int | None = 0, *, phase: str = "prefill",
                    outputs: list[str] | None = None) -> tuple[nx.DiGraph, str]:
    """A graph holding one `op` node fed by `input_types` (value name -> TType, in order).

    `weights_templates`: role -> checkpoint name template (``{layer}`` / ``{expert}``).
    Outputs are named "out" (one) or "out0", "out1", ... unless given; the node id is
    the first output's name (as in built graphs).  Returns (G, nid)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}")
    G = nx.DiGraph(phase=phase, model=model_config, spec_name="single_op", values=dict(input_types),
                   weights={}, inputs=list(input_types), outputs=[])
    full = _attrs_with_defaults(op, attrs, model_config)
    node = Node(op=op, attrs=full, weights=dict(weights_templates), layer=layer, model=model_config)
    out_types, wshapes = OPS[op].infer(node, list(input_types.values()), model_config)
    if outputs is None:
        outputs = ["out"] if len(out_types) == 1 else [f"out{i}" for i in range(len(out_types))]
    nid = outputs[0]
    add_op(G, nid, op, full, list(input_types), outputs, weights={}, layer=layer, path=f"single.{op}", order=0)
    G.nodes[nid]["weights"] = bind_weights(G, nid, weights_templates, wshapes, layer)
    G.graph["outputs"] = [o for o in outputs if G.graph["values"][o].dtype != "state"]
    return G, nid


# -- paged-cache step metadata ---------------------------------------------------------

def make_ctx(query_lens: list[int], context_lens: list[int] | None = None, *, block_size: int = 64,
             width: int | None = None, model=None, num_layers: int = 1, layer: int = 0,
             dtype: torch.dtype = torch.bfloat16, device="cuda", ref_dtype: torch.dtype = torch.float32,
             ref_device="cpu", spare_blocks: int = 3, seed: int = 0) -> tuple[StepContext, dict]:
    """Random paged-cache metadata for one step, as a StepContext (reference) and a ctx
    dict of device tensors (kernels).

    Sequence b has context_lens[b] tokens in the cache once this step has written its
    query_lens[b] new tokens (default: context == query, i.e. a fresh prefill).  Blocks
    are a random permutation of the pool (non-contiguous tables, spare blocks nobody
    owns); the cache holds random rows (the rows this step writes are random too: a
    kernel that reads them before writing them fails).  Cache width is `width` or the
    model's C + R.  The ctx dict holds: positions i64 [T], slot_mapping i64 [T],
    block_tables i32 [B, W], context_lens i32 [B], query_start i32 [B+1], key_start i32 [B+1],
    kv_cache [blocks, block_size, C+R] (of `layer`, in `dtype`).  The StepContext holds
    the same cache content in `ref_dtype` on `ref_device` (its own copy)."""
    if context_lens is None:
        context_lens = list(query_lens)
    if len(context_lens) != len(query_lens):
        raise ValueError("query_lens and context_lens differ in length")
    if any(q < 1 or c < q for q, c in zip(query_lens, context_lens)):
        raise ValueError(f"need 1 <= query_len <= context_len per sequence: {query_lens}, {context_lens}")
    if width is None:
        if model is None:
            raise ValueError("give the cache width or the model")
        width = model.cache_width
    gen = torch.Generator().manual_seed(seed)
    per_seq = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    W = max(per_seq)
    tables = torch.zeros(len(query_lens), W, dtype=torch.int32)
    positions, slots = [], []
    for b, (q, c) in enumerate(zip(query_lens, context_lens)):
        blocks = [pool.pop() for _ in range(per_seq[b])]
        tables[b, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(c - q, c):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
    positions_t = torch.tensor(positions, dtype=torch.int64)
    slots_t = torch.tensor(slots, dtype=torch.int64)
    query_start = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    caches = [torch.randn(num_blocks, block_size, width, generator=gen) for _ in range(num_layers)]
    step = StepContext(positions=positions_t.to(ref_device), query_lens=list(query_lens),
                       context_lens=list(context_lens), block_tables=tables.to(ref_device),
                       slot_mapping=slots_t.to(ref_device),
                       kv_cache=[c.to(ref_device, ref_dtype).clone() for c in caches], block_size=block_size)
    ctx = {
        "positions": positions_t.to(device), "slot_mapping": slots_t.to(device),
        "block_tables": tables.to(device), "context_lens": torch.tensor(context_lens, dtype=torch.int32).to(device),
        "query_start": query_start.to(device), "key_start": torch.tensor(step.key_starts(), dtype=torch.int32).to(device),
        "kv_cache": caches[layer].to(device, dtype).contiguous(),
    }
    return step, ctx


def step_sizes(step: StepContext, top_k: int = 1, **extra) -> dict[str, int]:
    """The runtime sizes a launch's expressions read: T, B, NP (= T * top_k), MAXQ, MAXCTX, TK, W."""
    T = step.num_tokens
    return {"T": T, "B": step.num_seqs, "NP": T * top_k, "MAXQ": max(step.query_lens),
            "MAXCTX": max(step.context_lens), "TK": sum(step.context_lens), "W": int(step.block_tables.shape[1]),
            **extra}


def ctx_dict(step: StepContext, *, layer: int = 0, dtype: torch.dtype = torch.bfloat16,
             device="cuda") -> dict:
    """The kernel-side ctx dict of an existing StepContext (copies its tensors to `device`)."""
    qs = torch.zeros(step.num_seqs + 1, dtype=torch.int32)
    qs[1:] = torch.cumsum(torch.tensor(step.query_lens), 0)
    return {"positions": step.positions.to(device), "slot_mapping": step.slot_mapping.to(device),
            "block_tables": step.block_tables.to(device, torch.int32),
            "context_lens": torch.tensor(step.context_lens, dtype=torch.int32).to(device),
            "query_start": qs.to(device), "key_start": torch.tensor(step.key_starts(), dtype=torch.int32).to(device),
            "kv_cache": step.kv_cache[layer].to(device, dtype).contiguous()}
