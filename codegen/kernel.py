"""What lowering produces for one graph node: kernel launches or a library call.

A kernel family is a module in ``codegen/families/`` that implements one or more graph
ops with one template (``templates/<family>.cu.j2``).  It exposes

    FAMILY: str                 e.g. "rms_norm"
    TEMPLATE: str               e.g. "rms_norm.cu.j2"
    OPS: tuple[str, ...]        graph ops it implements, e.g. ("rms_norm",)
    def lower(nid: str, G, opts: Options) -> list[KernelLaunch]   (usually one; split-KV attention: two)

Launch geometry and size arguments are *expressions* over the step's runtime sizes,
evaluated by the runtime just before launching (no host sync: all are host-known):

    T      tokens in the step             B      sequences in the step
    NP     token-expert pairs (T * K)     MAXQ   longest query of the step (prefill)
    MAXCTX longest context of the step    W      block-table width
    SMS    streaming multiprocessors of the device the step runs on (the runner reads it
           from the device; codegen/sizes.py DEVICE_SIZES)
    and integer literals, + - * // ( ), cdiv(a, b) = ceil(a / b), max(a, b), min(a, b)

Arguments are typed: each ``Arg`` is one kernel parameter (its C name and C type, from
which the template's parameter list is rendered: the signature has this one source) and
a reference saying what the runtime binds to it:

    ValueRef(name)             a graph value's device pointer (views have strides; see StrideRef).
                               A value of dtype "routing" lives in two int32 buffers, named
                               "<R>.order" (pairs sorted by expert) and "<R>.offsets" [E + 1]
    WeightRef(name)            a bound weight (checkpoint name, or "....experts.*.gate_proj.weight")
    CtxRef(field)              a step-metadata tensor (CTX_FIELDS)
    WorkspaceRef(name)         a scratch buffer declared in KernelLaunch.workspace
    StrideRef(value, dim)      the element stride of a value's view along dim (i64)
    SizeRef(expr)              a runtime-size expression, e.g. "T"

Numbers that change the computation (eps, softmax scale, rope tables) are template
parameters, so they appear in the generated source that reviewers diff.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

DTYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}

# Step-metadata tensors a kernel may read: field -> element C type.
CTX_FIELDS = {
    "positions": "i64",        # [T]
    "slot_mapping": "i64",     # [T]
    "block_tables": "i32",     # [B, W]
    "context_lens": "i32",     # [B]
    "query_start": "i32",      # [B + 1]
    "kv_cache": "act",         # [blocks, block_size, C + R] of the node's layer
}

# C scalar types a kernel parameter may have -> the width the runtime passes.
SCALAR_KINDS = {"int": "i32", "i32": "i32", "i64": "i64", "float": "f32"}


@dataclass(frozen=True)
class Options:
    """Bundle-wide compile options (part of the cache key).  These defaults are dsgraph's
    defaults everywhere: `dsgraph compile`, the Engine, the bench and the goldens."""
    arch: str = "sm_90"
    dtype: str = "bf16"          # activation / weight dtype: bf16 | fp16 | fp32
    block_size: int = 64         # KV-cache page size (tokens per block)


DEFAULTS = Options()


# -- argument references --------------------------------------------------------------

@dataclass(frozen=True)
class ValueRef:
    name: str


@dataclass(frozen=True)
class WeightRef:
    name: str


@dataclass(frozen=True)
class CtxRef:
    field: str


@dataclass(frozen=True)
class WorkspaceRef:
    name: str


@dataclass(frozen=True)
class StrideRef:
    value: str
    dim: int


@dataclass(frozen=True)
class SizeRef:
    expr: str


Ref = Union[ValueRef, WeightRef, CtxRef, WorkspaceRef, StrideRef, SizeRef]
POINTER_REFS = (ValueRef, WeightRef, CtxRef, WorkspaceRef)
_REF_TAGS = {ValueRef: "value", WeightRef: "weight", CtxRef: "ctx", WorkspaceRef: "workspace",
             StrideRef: "stride", SizeRef: "size"}
_TAG_REFS = {tag: cls for cls, tag in _REF_TAGS.items()}


def ref_to_json(ref: Ref) -> dict:
    """{"value": "L0.x"}, {"stride": ["L0.x", 0]}, ... (one key: the reference's kind)."""
    tag = _REF_TAGS[type(ref)]
    if isinstance(ref, StrideRef):
        return {tag: [ref.value, ref.dim]}
    return {tag: next(iter(ref.__dict__.values()))}


def ref_from_json(data) -> Ref:
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError(f"an argument reference is a one-key object, got {data!r}")
    (tag, payload), = data.items()
    cls = _TAG_REFS.get(tag)
    if cls is None:
        raise ValueError(f"unknown argument reference kind {tag!r} (one of {', '.join(_TAG_REFS)})")
    if cls is StrideRef:
        value, dim = payload
        return StrideRef(str(value), int(dim))
    return cls(str(payload))


def describe_ref(ref: Ref) -> str:
    """How a reference reads in a message: "value L0.mla.q", "stride L0.x:0"."""
    if isinstance(ref, StrideRef):
        return f"stride {ref.value}:{ref.dim}"
    return f"{_REF_TAGS[type(ref)]} {next(iter(ref.__dict__.values()))}"


# -- arguments -------------------------------------------------------------------------

@dataclass(frozen=True)
class Arg:
    """One kernel parameter: its C name, its C type, and what the runtime binds to it.

    ctype is a pointer ("const __nv_bfloat16*", "float*", "const i32*"; rendered with
    __restrict__) or a scalar ("int", "i64", "float")."""
    name: str
    ctype: str
    ref: Ref

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def kind(self) -> str:
        """ptr | i32 | i64 | f32: how the runtime passes it."""
        return "ptr" if self.is_pointer else SCALAR_KINDS[self.ctype]

    def declaration(self) -> str:
        if self.is_pointer:
            return f"{self.ctype} __restrict__ {self.name}"
        return f"{self.ctype} {self.name}"

    def to_json(self) -> dict:
        return {"name": self.name, "ctype": self.ctype, "ref": ref_to_json(self.ref)}

    @classmethod
    def from_json(cls, data: dict) -> "Arg":
        return cls(str(data["name"]), str(data["ctype"]), ref_from_json(data["ref"]))


def signature(args) -> str:
    """The kernel's parameter list, one parameter per line (what templates render)."""
    return ",\n    ".join(a.declaration() for a in args)


def signature_key(args) -> tuple:
    """What two launches of one kernel must agree on: names and C types, in order."""
    return tuple((a.name, a.ctype) for a in args)


# Small constructors the families use, so a parameter reads as what it is.

def inp(name: str, ctype: str, value: str) -> Arg:
    """A read-only graph value."""
    return Arg(name, f"const {ctype}*", ValueRef(value))


def out(name: str, ctype: str, value: str) -> Arg:
    """A graph value the kernel writes."""
    return Arg(name, f"{ctype}*", ValueRef(value))


def weight(name: str, ctype: str, bound: str) -> Arg:
    return Arg(name, f"const {ctype}*", WeightRef(bound))


def ctx(name: str, fld: str, act_ctype: str | None = None, *, writes: bool = False) -> Arg:
    """A step-metadata tensor; the kv_cache's element type is the activation type."""
    elem = CTX_FIELDS[fld]
    if elem == "act":
        if act_ctype is None:
            raise ValueError(f"ctx field {fld} needs the activation C type")
        elem = act_ctype
    return Arg(name, f"{'' if writes else 'const '}{elem}*", CtxRef(fld))


def work(name: str, ctype: str, ws: str, *, writes: bool = True) -> Arg:
    return Arg(name, f"{'' if writes else 'const '}{ctype}*", WorkspaceRef(ws))


def stride(name: str, value: str, dim: int) -> Arg:
    return Arg(name, "i64", StrideRef(value, dim))


def size(name: str, expr: str) -> Arg:
    return Arg(name, "int", SizeRef(expr))


# -- launches and library calls -----------------------------------------------------------

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
    stage: str = ""              # which launch of the family's node ("split", "combine", ...)
    origins: tuple = ()          # provenance (codegen.provenance.Origin), set by lowering

    @property
    def role(self) -> str:
        """What the kernel is for, independent of the dims in its name: family[.stage]."""
        return f"{self.family}.{self.stage}" if self.stage else self.family


@dataclass(frozen=True)
class LibraryCall:
    """A node left to a library (cuBLAS through torch); the manifest says which.

    A node may have both kernel launches and a library call (a linear: the skinny kernel for
    few tokens, cuBLAS above): the call then runs from `from_tokens` tokens on and the launches
    below (their grids are 0 from there on), so a step runs exactly one of them."""
    node: str
    op: str                      # linear | multi_linear | split | ... (codegen.lower.LIBRARY_CALLS)
    call: str                    # e.g. "torch.nn.functional.linear"
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weights: tuple[str, ...] = ()
    attrs: dict = field(default_factory=dict)   # the node's attributes (e.g. linear precision)
    from_tokens: int = 1         # the call runs in steps of at least this many tokens (T)

    def runs_at(self, tokens: int) -> bool:
        return tokens >= self.from_tokens
