"""What lowering produces for one graph node: kernel launches or a library call.

A kernel family is a module in ``codegen/families/`` that implements one or more graph
ops with one template (``templates/<family>.cu.j2``).  It exposes

    FAMILY: str                 e.g. "rms_norm"
    TEMPLATE: str               e.g. "rms_norm.cu.j2"
    OPS: tuple[str, ...]        graph ops it implements, e.g. ("rms_norm",)
    def lower(nid: str, G, opts: Options) -> list[KernelLaunch]   (usually one; several where
                                the form depends on T: grid factors give one of them work a step)
    PDL: bool                   optional, default False: every kernel of the family keeps the contract of
                                templates/include/pdl.cuh (each CTA calls dsg::pdl_wait() before it reads
                                another kernel's output or writes anything), so lowering marks its
                                launches KernelLaunch.pdl and the runtime launches them with programmatic
                                dependent launch (each overlaps the tail of the kernel before it)

Launch geometry and size arguments are *expressions* over the step's runtime sizes,
evaluated by the runtime just before launching (no host sync: all are host-known):

    T      tokens in the step             B      sequences in the step
    NP     token-expert pairs (T * K)     MAXQ   longest query of the step (prefill)
    MAXCTX longest context of the step    W      block-table width
    TK     context rows of the step (the sum of the context lengths: mla_gather_context's rows)
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
    TensorMapRef(weight, box, swizzle)
                               a TMA descriptor of a bound weight (sm_90: templates/include/tma.cuh),
                               passed by value as `const __grid_constant__ dsg::TensorMap`: box is
                               the extent of one copy over the weight's trailing dims, outermost
                               first (leading dims get 1), swizzle its shared-memory swizzle in
                               bytes.  Weights are static, so the runtime encodes one per weight
                               (cuTensorMapEncodeTiled) and reuses it

Numbers that change the computation (eps, softmax scale, rope tables) are template
parameters, so they appear in the generated source that reviewers diff.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from .tuning import DEFAULT_TUNING, Tuning, as_tuning

DTYPES = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}

# Step-metadata tensors a kernel may read: field -> element C type.
CTX_FIELDS = {
    "positions": "i64",        # [T]
    "slot_mapping": "i64",     # [T]
    "block_tables": "i32",     # [B, W]
    "context_lens": "i32",     # [B]
    "query_start": "i32",      # [B + 1]
    "key_start": "i32",        # [B + 1]: where each sequence's context rows start, packed (prefill)
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
    pdl: bool = True             # launch the kernels of PDL families (FAMILY.PDL) with programmatic
                                 # dependent launch; False: every launch waits for the one before it
    tuning: Tuning = DEFAULT_TUNING   # which kernel serves which size, tiles (codegen/tuning.py)

    def __post_init__(self):
        if not isinstance(self.tuning, Tuning):
            object.__setattr__(self, "tuning", as_tuning(self.tuning))


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


@dataclass(frozen=True)
class TensorMapRef:
    weight: str
    box: tuple                   # ints: the copy's extent over the trailing dims, outermost first
    swizzle: int = 128           # bytes: 0 (none), 32, 64 or 128


Ref = Union[ValueRef, WeightRef, CtxRef, WorkspaceRef, StrideRef, SizeRef, TensorMapRef]
POINTER_REFS = (ValueRef, WeightRef, CtxRef, WorkspaceRef)
# The C type of a tensor-map parameter (templates/include/tma.cuh), passed by value.
TENSOR_MAP_CTYPE = "dsg::TensorMap"
_REF_TAGS = {ValueRef: "value", WeightRef: "weight", CtxRef: "ctx", WorkspaceRef: "workspace",
             StrideRef: "stride", SizeRef: "size", TensorMapRef: "tensor_map"}
_TAG_REFS = {tag: cls for cls, tag in _REF_TAGS.items()}


def ref_to_json(ref: Ref) -> dict:
    """{"value": "L0.x"}, {"stride": ["L0.x", 0]}, {"tensor_map": ["w", [128, 64], 128]}, ... (one key:
    the reference's kind)."""
    tag = _REF_TAGS[type(ref)]
    if isinstance(ref, StrideRef):
        return {tag: [ref.value, ref.dim]}
    if isinstance(ref, TensorMapRef):
        return {tag: [ref.weight, list(ref.box), ref.swizzle]}
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
    if cls is TensorMapRef:
        weight_name, box, swizzle = payload
        return TensorMapRef(str(weight_name), tuple(int(b) for b in box), int(swizzle))
    return cls(str(payload))


def describe_ref(ref: Ref) -> str:
    """How a reference reads in a message: "value L0.mla.q", "stride L0.x:0"."""
    if isinstance(ref, StrideRef):
        return f"stride {ref.value}:{ref.dim}"
    if isinstance(ref, TensorMapRef):
        return f"tensor_map {ref.weight} box {'x'.join(map(str, ref.box))}"
    return f"{_REF_TAGS[type(ref)]} {next(iter(ref.__dict__.values()))}"


# -- arguments -------------------------------------------------------------------------

@dataclass(frozen=True)
class Arg:
    """One kernel parameter: its C name, its C type, and what the runtime binds to it.

    ctype is a pointer ("const __nv_bfloat16*", "float*", "const i32*"; rendered with
    __restrict__), a scalar ("int", "i64", "float") or a tensor map (TENSOR_MAP_CTYPE, rendered
    `const __grid_constant__`: a 128-byte parameter whose address the TMA copies take)."""
    name: str
    ctype: str
    ref: Ref

    @property
    def is_pointer(self) -> bool:
        return self.ctype.endswith("*")

    @property
    def is_tensor_map(self) -> bool:
        return self.ctype == TENSOR_MAP_CTYPE

    @property
    def kind(self) -> str:
        """ptr | i32 | i64 | f32 | tmap: how the runtime passes it."""
        if self.is_tensor_map:
            return "tmap"
        return "ptr" if self.is_pointer else SCALAR_KINDS[self.ctype]

    def declaration(self) -> str:
        if self.is_pointer:
            return f"{self.ctype} __restrict__ {self.name}"
        if self.is_tensor_map:
            return f"const __grid_constant__ {self.ctype} {self.name}"
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


def tensor_map(name: str, bound: str, box: tuple, swizzle: int = 128) -> Arg:
    """A TMA descriptor of weight `bound` (TensorMapRef)."""
    return Arg(name, TENSOR_MAP_CTYPE, TensorMapRef(bound, tuple(box), swizzle))


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
    pdl: bool = False            # programmatic dependent launch (set by lowering: the family's PDL
                                 # and Options.pdl); the kernel keeps templates/include/pdl.cuh's contract
    requires: tuple[str, ...] = ()   # architecture-specific features it is built with (codegen/arch.py)

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
