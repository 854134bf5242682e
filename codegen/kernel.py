"""What lowering produces for one graph node: a kernel launch or a library call.

A kernel family is a module in ``codegen/families/`` that implements one or more graph
ops with one template (``templates/<family>.cu.j2``).  It exposes

    FAMILY: str                 e.g. "rms_norm"
    TEMPLATE: str               e.g. "rms_norm.cu.j2"
    OPS: tuple[str, ...]        graph ops it implements, e.g. ("rms_norm",)
    def lower(nid: str, G, opts: Options) -> list[KernelLaunch]   (usually one; split-KV attention: two)

Launch geometry and scalar arguments are *expressions* over the step's runtime sizes,
evaluated by the runtime just before launching (no host sync: all are host-known):

    T      tokens in the step             B      sequences in the step
    NP     token-expert pairs (T * K)     MAXQ   longest query of the step (prefill)
    MAXCTX longest context of the step    and integer literals, + - * // ( ) and
    cdiv(a, b) = ceil(a / b),  max(a, b),  min(a, b)

Argument references (``Arg.ref``):
    "value:<name>"            a graph value's device pointer (views have strides; see stride args)
    "weight:<name>"           a bound weight (checkpoint name, or "model.layers.1.mlp.experts.*.gate_proj.weight")
    "ctx:<field>"             a step-metadata tensor: positions [T] i64, slot_mapping [T] i64,
                              block_tables [B, W] i32, context_lens [B] i32, query_start [B+1] i32,
                              kv_cache (this node's layer) [blocks, block_size, C+R]
    "workspace:<name>"        a scratch buffer declared in KernelLaunch.workspace
    "value:<R>.order" / "value:<R>.offsets"
                              a value of dtype "routing" lives in two int32 buffers: pairs sorted
                              by expert [NP] and each expert's start in that order [E + 1]
    "stride:<value>:<dim>"    (i64) the element stride of a value's view along dim
    "size:<expr>"             (i32 or i64) a runtime-size expression, e.g. "size:T"
    "const:<number>"          (f32/i32) a literal, e.g. the softmax scale
"""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}


@dataclass(frozen=True)
class Options:
    """Bundle-wide compile options (part of the cache key)."""
    arch: str = "sm_90"
    dtype: str = "bf16"          # activation / weight dtype: bf16 | fp16 | fp32
    block_size: int = 64         # KV-cache page size (tokens per block)


@dataclass(frozen=True)
class Arg:
    kind: str                    # ptr | i32 | i64 | f32
    ref: str


@dataclass(frozen=True)
class Workspace:
    name: str
    shape: tuple                 # expressions, like grid entries
    dtype: str                   # f32 | i32 | i64 | act


@dataclass(frozen=True)
class KernelLaunch:
    family: str
    template: str
    name: str                    # kernel_name(family, parts): readable and unique per params
    params: dict                 # compile-time constants rendered into the template
    nodes: tuple[str, ...]       # graph nodes this launch implements
    grid: tuple                  # 3 expressions
    block: tuple[int, int, int]
    args: tuple[Arg, ...]
    smem: int | str = 0          # bytes of dynamic shared memory (int or expression)
    workspace: tuple[Workspace, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class LibraryCall:
    """A node left to a library (cuBLAS through torch) at first; the manifest says which."""
    node: str
    op: str                      # linear | mla_q_absorb | mla_v_up | view ...
    call: str                    # e.g. "torch.nn.functional.linear"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    attrs: dict = field(default_factory=dict)   # the node's attributes (e.g. linear precision)
