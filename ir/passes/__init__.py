"""The pass pipeline: the table of contents of the compiler.

Each pass is a function graph -> graph in its own file (its docstring draws the
pattern before and after); it copies its input and never edits it.  ``run_pipeline``
runs, in order, the passes that apply to the graph's phase and verifies the graph
after each one.  Fusions a pass declines are logged on the ``dsgraph.passes``
logger ("cannot fuse A with B: reason") and listed in ``G.graph["refusals"]``.
A pass with a ``knob`` runs only where the caller names that knob in ``knobs``
(codegen.lower.pipeline_knobs: the compile options' tuning switches it on).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import networkx as nx

from ..errors import GraphError
from ..verifier import verify
from .eliminate_dead import eliminate_dead
from .fuse_add_rms_norm import fuse_add_rms_norm
from .fuse_combine_shared_residual import fuse_combine_shared_residual
from .fuse_decode_prologue import fuse_decode_prologue
from .fuse_expert_ffn import fuse_expert_ffn
from .fuse_gate_up_silu import fuse_gate_up_silu
from .fuse_kv_norm_rope_cache import fuse_kv_norm_rope_cache
from .fuse_moe_silu import fuse_moe_silu
from .fuse_norm_fp8_quant import fuse_norm_fp8_quant
from .fuse_norm_int8_quant import fuse_norm_int8_quant
from .fuse_v_up_fp8_quant import fuse_v_up_fp8_quant
from .fuse_q_rope_into_query import fuse_q_rope_into_query
from .fuse_router import fuse_router
from .fuse_shared_experts import fuse_shared_experts
from .fuse_sibling_linears import fuse_sibling_linears
from .insert_all_reduce import insert_all_reduce
from .lower_mla_decode import lower_mla_decode
from .lower_mla_prefill import lower_mla_prefill
from .shard_for_rank import shard_for_rank
from .split_rope import split_rope


@dataclass(frozen=True)
class Pass:
    run: Callable[[nx.DiGraph], nx.DiGraph]
    phases: tuple[str, ...]
    knob: str | None = None    # "section.knob" of codegen.tuning that switches it on; None: always runs

    @property
    def name(self) -> str:
        return self.run.__name__


BOTH = ("prefill", "decode")
PREFILL = ("prefill",)
DECODE = ("decode",)

PIPELINE: list[Pass] = [
    # Tensor / expert parallelism (a no-op unless G.graph["parallel"] asks for more than one rank)
    Pass(shard_for_rank,               BOTH),     # the rank's heads, FFN columns and experts (ir/parallel.py)
    Pass(insert_all_reduce,            BOTH),     # partial sums -> all_reduce before whoever needs them whole
    # MLA attention
    Pass(split_rope,                   BOTH),     # rope(q, k) -> rope_q, rope_k
    Pass(fuse_kv_norm_rope_cache,      BOTH),     # kv_a_layernorm + rope_k + cache_write -> mla_kv_cache_write
    Pass(lower_mla_prefill,            PREFILL),  # mla_attention -> linear(kv_b) + mla_prefill_attention
    Pass(lower_mla_decode,             DECODE),   # mla_attention -> q_absorb, decode_attention (576-wide rows), v_up
    Pass(fuse_q_rope_into_query,       BOTH),     # q_absorb + rope_q -> mla_decode_query (refused in prefill)
    Pass(fuse_decode_prologue,         DECODE),   # mla_decode_query + mla_kv_cache_write -> mla_decode_prologue
    # DeepSeekMoE
    Pass(fuse_router,                  BOTH),     # linear(gate) + moe_topk + moe_align -> moe_route
    Pass(fuse_moe_silu,                BOTH),     # moe_gate_up + silu_and_mul -> moe_gate_up_silu
    Pass(fuse_combine_shared_residual, BOTH),     # moe_combine + shared add + residual add -> moe_combine_residual
    Pass(fuse_shared_experts,          BOTH),     # the shared MLP -> S always-selected experts in the grouped ops
    Pass(fuse_expert_ffn,              DECODE),   # moe_gate_up_silu + moe_down -> moe_expert_ffn (decode: one persistent launch)
    # Dense linears
    Pass(fuse_sibling_linears,         BOTH),     # linears reading one input (q + kv_a, gate + up) -> multi_linear
    Pass(fuse_gate_up_silu,            BOTH),     # multi_linear (gate, up) + silu_and_mul -> gate_up_silu
    # Residual stream
    Pass(fuse_add_rms_norm,            BOTH),     # add (or moe_combine_residual) + rms_norm -> one op
    # Quantised activations
    Pass(fuse_norm_int8_quant,         BOTH, knob="linear.norm_int8"),   # a norm feeding int8 linears also
                                                                         # writes their int8 rows
    Pass(fuse_norm_fp8_quant,          BOTH, knob="linear.norm_fp8"),    # ... feeding FP8 x FP8 GEMMs, their
                                                                         # e4m3 rows and scales
    Pass(fuse_v_up_fp8_quant,          DECODE, knob="linear.v_up_fp8"),  # mla_v_up feeding FP8 o_proj: its
                                                                         # e4m3 rows and scales
    # Clean-up
    Pass(eliminate_dead,               BOTH),     # drop ops nobody reads (cache writes always stay)
]


def _run_one(p: Pass, G: nx.DiGraph) -> nx.DiGraph:
    """Run one pass with its name in G.graph["running_pass"], where rewrite.replace reads it to
    record which passes made a node (provenance); the name is gone again from both graphs after."""
    G.graph["running_pass"] = p.name
    try:
        out = p.run(G)
    finally:
        G.graph.pop("running_pass", None)
    out.graph.pop("running_pass", None)
    return out


def run_pipeline(G: nx.DiGraph, passes: list[Pass] = PIPELINE, knobs: frozenset = frozenset()) -> nx.DiGraph:
    """Run the passes that apply to ``G.graph["phase"]`` (a knob-gated one where ``knobs`` names its
    knob), verifying after each; ``G`` is not changed."""
    phase = G.graph["phase"]
    for p in passes:
        if phase not in p.phases or (p.knob is not None and p.knob not in knobs):
            continue
        G = _run_one(p, G)
        try:
            verify(G)
        except GraphError as exc:
            raise GraphError(f"after pass {p.name}: {exc}") from exc
    return G


__all__ = ["PIPELINE", "Pass", "run_pipeline", "eliminate_dead", "fuse_add_rms_norm", "fuse_combine_shared_residual",
           "fuse_decode_prologue", "fuse_expert_ffn",
           "fuse_gate_up_silu", "fuse_kv_norm_rope_cache", "fuse_moe_silu", "fuse_norm_fp8_quant",
           "fuse_norm_int8_quant", "fuse_q_rope_into_query", "fuse_router", "fuse_v_up_fp8_quant",
           "fuse_shared_experts", "fuse_sibling_linears", "insert_all_reduce", "lower_mla_decode", "lower_mla_prefill", "shard_for_rank",
           "split_rope"]
