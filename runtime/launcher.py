"""Run KernelLaunch records on torch tensors: compile (or load) once, resolve args, launch.

`KernelRunner` is the one place where the lowering contract of codegen/kernel.py
meets the CUDA driver: it evaluates a launch's grid / shared memory / workspace
shapes over the step's sizes (codegen/sizes.py), allocates its workspaces,
binds every typed argument reference to a tensor, a width-tagged scalar or a TMA
descriptor (encoded once per weight and kept), and launches on torch's current stream (or the
one given), as a programmatic dependent launch where the record says so (KernelLaunch.pdl).
No host synchronisation happens here, so a step of launches can be captured as a CUDA graph.

Modules come either from NVRTC on demand (`KernelRunner()`, used by the kernel
tests; `templates_dir=` renders from another copy of templates/, e.g. a planted
mutant) or from a compiled bundle (`KernelRunner.from_bundle(dir)`, never compiles).
"""
from __future__ import annotations

import ctypes
import functools
import json
from pathlib import Path

import torch

from codegen import sizes as size_exprs
from codegen.errors import DsgraphError
from codegen.kernel import (Arg, CtxRef, KernelLaunch, SizeRef, StrideRef, TensorMapRef, ValueRef, WeightRef,
                            WorkspaceRef, describe_ref)

_WORKSPACE_DTYPES = {"f32": torch.float32, "i32": torch.int32, "i64": torch.int64}


class LaunchError(DsgraphError, RuntimeError):
    """A launch cannot be bound: a missing tensor, a bad ref, a kernel the bundle lacks."""


def _act_dtype(values: dict, weights: dict) -> torch.dtype:
    for group in (values, weights):
        for t in group.values():
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return t.dtype
    raise LaunchError("a workspace of dtype 'act' needs at least one float tensor among the "
                      "values or weights to take its dtype from")


def _device(values: dict, weights: dict, ctx: dict) -> torch.device:
    for group in (values, weights, ctx):
        for t in group.values():
            if isinstance(t, torch.Tensor):
                return t.device
    return torch.device("cuda", torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _sm_count(values: dict, ctx: dict) -> int | None:
    """The SM count of the CUDA device the step's tensors are on (torch's current device if none
    is a CUDA tensor). None where there is no CUDA device at all: then an expression that reads
    SMS fails to evaluate with a message naming it (the runner cannot launch there anyway)."""
    if not torch.cuda.is_available():
        return None
    dev = _device(values, {}, ctx)
    return _device_sm_count(dev.index if dev.type == "cuda" and dev.index is not None
                            else torch.cuda.current_device())


def _lookup_value(values: dict, name: str, launch: KernelLaunch, ref) -> torch.Tensor:
    """A value tensor; routing parts "<R>.order"/"<R>.offsets" may also be given as
    values["<R>"] = {"order": ..., "offsets": ...} (what the reference op returns)."""
    if name in values:
        return values[name]
    base, _, part = name.rpartition(".")
    if base and part in ("order", "offsets") and isinstance(values.get(base), dict):
        return values[base][part]
    raise LaunchError(f"kernel {launch.name}: argument {describe_ref(ref)} needs value {name!r}; "
                      f"values given: {', '.join(sorted(values)) or '(none)'}")


# What a launch argument is fetched from at launch time (_Bound.fetch): the first four index the
# tables _run looks tensors up in; the rest are resolved otherwise.
_VALUE, _WEIGHT, _CTX, _WORKSPACE, _CONST, _STRIDE, _TMAP = range(7)
_POINTER_TABLES = {ValueRef: (_VALUE, "name"), WeightRef: (_WEIGHT, "name"), CtxRef: (_CTX, "field"),
                   WorkspaceRef: (_WORKSPACE, "name")}


_BOUNDS_KEPT = 1 << 15   # _Bound records kept (~600 a step's sizes) before the cache starts over


def _size_names(launch: KernelLaunch) -> tuple:
    """The step / device sizes a launch's grid, shared memory, workspaces and size arguments read."""
    names = set()
    for expr in (*launch.grid, launch.smem, *(d for ws in launch.workspace for d in ws.shape),
                 *(a.ref.expr for a in launch.args if isinstance(a.ref, SizeRef))):
        names |= size_exprs.names(expr)
    return tuple(sorted(names))


def _stream_handle(stream):
    """The raw handle of `stream` (None: torch's current stream, resolved here once for a run of
    launches; no CUDA: left as None for the driver layer, which resolves it at launch)."""
    if stream is None:
        return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else None
    return stream.cuda_stream if isinstance(stream, torch.cuda.Stream) else stream


class _Bound:
    """One KernelLaunch at one set of step sizes: everything the sizes decide, worked out once.

    grid (None when a dimension is 0: nothing launches), shared memory, the workspaces'
    (name, shape, dtype) and, per argument, its ctypes type and how _run fetches it: a packed
    constant (a size), a table and name (a tensor), a value's stride, or a tensor map.  The
    CUfunction is looked up at the first launch (it loads the module)."""
    __slots__ = ("launch", "grid", "smem", "workspaces", "fetch", "types", "func")

    @classmethod
    def make(cls, launch: KernelLaunch, sizes: dict, *, geometry_only: bool = False):
        from .cuda_driver import _dims
        b = cls()
        b.launch, b.func = launch, None
        grid = _dims("grid", tuple(size_exprs.evaluate(g, sizes) for g in launch.grid), allow_zero=True)
        _dims("block", tuple(launch.block), allow_zero=False)
        b.grid = None if 0 in grid else grid
        b.smem = size_exprs.evaluate(launch.smem, sizes)
        workspaces = []
        for ws in launch.workspace:
            if ws.dtype != "act" and ws.dtype not in _WORKSPACE_DTYPES:
                raise LaunchError(f"kernel {launch.name}: workspace {ws.name} has unknown dtype "
                                  f"{ws.dtype!r} (f32 | i32 | i64 | act)")
            workspaces.append((ws.name, tuple(size_exprs.evaluate(d, sizes) for d in ws.shape),
                               "act" if ws.dtype == "act" else _WORKSPACE_DTYPES[ws.dtype]))
        b.workspaces = tuple(workspaces)
        b.fetch, b.types = (), ()
        if b.grid is None or geometry_only:
            return b
        from .cuda_driver import I32, I64
        fetch, types = [], []
        scalar_types = {"i32": ctypes.c_int, "i64": ctypes.c_longlong, "f32": ctypes.c_float}
        for arg in launch.args:
            ref = arg.ref
            if isinstance(ref, TensorMapRef):
                fetch.append((_TMAP, None))
                types.append(None)     # by address: cuda-bindings copies the 128 bytes
            elif arg.is_pointer:
                if type(ref) not in _POINTER_TABLES:
                    raise LaunchError(f"kernel {launch.name}: pointer argument {arg.name} binds {describe_ref(ref)}")
                table, field = _POINTER_TABLES[type(ref)]
                fetch.append((table, getattr(ref, field)))
                types.append(ctypes.c_void_p)
            elif isinstance(ref, StrideRef):
                fetch.append((_STRIDE, (ref.value, ref.dim)))
                types.append(scalar_types[arg.kind])
            elif isinstance(ref, SizeRef):
                n = size_exprs.evaluate(ref.expr, sizes)
                value = float(n) if arg.kind == "f32" else {"i32": I32, "i64": I64}[arg.kind](n).value
                fetch.append((_CONST, value))
                types.append(scalar_types[arg.kind])
            else:
                raise LaunchError(f"kernel {launch.name}: scalar argument {arg.name} binds {describe_ref(ref)}")
        b.fetch, b.types = tuple(fetch), tuple(types)
        return b


class KernelRunner:
    """Compile-or-load and launch kernels described by KernelLaunch records."""

    def __init__(self, arch: str | None = None, *, options: tuple[str, ...] = (), templates_dir=None):
        self._arch = arch
        self._options = tuple(options)
        self._templates_dir = templates_dir
        self._modules: dict[str, object] = {}        # kernel name -> LoadedModule
        self._cubins: dict[str, bytes] | None = None  # set by from_bundle: no compiling then
        self._tensor_maps: dict[tuple, object] = {}  # (weight address, geometry, box) -> TensorMap
        # Programmatic dependent launch where the record says so; False launches every kernel plain
        # (a profile of each kernel's own device time: with PDL a kernel's wait for its predecessor
        # counts in its duration).  The kernels are the same either way (pdl.cuh).
        self.pdl = True
        self._bounds: dict[tuple, _Bound] = {}       # (id(launch), the sizes it reads) -> what they decide
        self._reads: dict[int, tuple] = {}           # id(launch) -> (launch, the size names it reads)
        self.sources: dict[str, str] = {}            # kernel name -> rendered CUDA (compiled ones)

    @property
    def arch(self) -> str:
        """The NVRTC target: as given, else the one dsgraph compiles for on this device
        (codegen/arch.py target_arch: the default target where the device runs it)."""
        if self._arch is None:
            from codegen.arch import target_arch

            from .cuda_driver import device_arch
            self._arch = target_arch(device_arch())
        return self._arch

    @classmethod
    def from_bundle(cls, bundle) -> "KernelRunner":
        """A runner over a bundle's CUBINs (a codegen.bundle.LoadedBundle, or a bundle folder,
        whose manifest and checksums are then verified): it never compiles, and a launch of a
        kernel the bundle lacks is an error."""
        if hasattr(bundle, "manifest"):
            bundle_dir, manifest = Path(bundle.path), bundle.manifest
        else:
            from codegen.bundle import load_manifest
            bundle_dir = Path(bundle)
            manifest = load_manifest(bundle_dir)
        runner = cls(manifest["arch"])
        runner._cubins = {name: (bundle_dir / k["cubin"]).read_bytes() for name, k in manifest["kernels"].items()}
        return runner

    # -- modules --------------------------------------------------------------

    def source(self, launch: KernelLaunch) -> str:
        from codegen.render import render_launch
        return render_launch(launch, templates_dir=self._templates_dir)

    def cubin(self, launch: KernelLaunch) -> bytes:
        if self._cubins is not None:
            try:
                return self._cubins[launch.name]
            except KeyError:
                raise LaunchError(f"kernel {launch.name} (nodes {', '.join(launch.nodes)}) is not "
                                  f"in this bundle; recompile the bundle") from None
        from codegen.arch import features, kernel_target
        from codegen.nvrtc import compile_cubin
        from codegen.render import include_closure
        missing = set(launch.requires) - features(self.arch)
        if missing:
            raise LaunchError(f"kernel {launch.name} is built with {', '.join(sorted(missing))} features, which "
                              f"this runner's target {self.arch} does not offer (KernelRunner(arch=...))")
        src = self.source(launch)
        self.sources[launch.name] = src
        return compile_cubin(src, launch.name, arch=kernel_target(self.arch, launch.requires), options=self._options,
                             template=launch.template, nodes=tuple(launch.nodes),
                             headers=include_closure(src, self._templates_dir)).cubin

    def module(self, launch: KernelLaunch):
        mod = self._modules.get(launch.name)
        if mod is None:
            from .cuda_driver import LoadedModule
            mod = LoadedModule.load(self.cubin(launch), launch.name)
            self._modules[launch.name] = mod
        return mod

    # -- binding --------------------------------------------------------------

    def _tensor_map(self, arg: Arg, launch: KernelLaunch, weights: dict):
        """The TMA descriptor a TensorMapRef asks for, encoded once per weight (weights are static:
        the key is the tensor's address and geometry, so a new tensor gets a new map)."""
        from .cuda_driver import TensorMapError, encode_tensor_map
        ref = arg.ref
        t = weights.get(ref.weight)
        if not isinstance(t, torch.Tensor):
            raise LaunchError(f"kernel {launch.name}: argument {arg.name} ({describe_ref(ref)}) needs weight "
                              f"{ref.weight!r}; given: {', '.join(sorted(k for k, v in weights.items() if v is not None)) or '(none)'}")
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, ref.box, ref.swizzle)
        tmap = self._tensor_maps.get(key)
        if tmap is None:
            try:
                tmap = encode_tensor_map(t, ref.box, ref.swizzle)
            except TensorMapError as e:
                raise LaunchError(f"kernel {launch.name}: argument {arg.name} ({describe_ref(ref)}): {e}") from None
            self._tensor_maps[key] = tmap
        return tmap

    def _arg(self, arg: Arg, launch: KernelLaunch, values, weights, ctx, workspaces, sizes):
        from .cuda_driver import F32, I32, I64
        ref = arg.ref
        if isinstance(ref, TensorMapRef):
            return self._tensor_map(arg, launch, weights)
        if arg.is_pointer:
            if isinstance(ref, ValueRef):
                return _lookup_value(values, ref.name, launch, ref)
            index, key = _POINTER_TABLES[type(ref)]
            table, name = (values, weights, ctx, workspaces)[index], getattr(ref, key)
            if name not in table or table[name] is None:
                raise LaunchError(f"kernel {launch.name}: argument {arg.name} ({describe_ref(ref)}) is not given; "
                                  f"given: {', '.join(sorted(k for k, v in table.items() if v is not None)) or '(none)'}")
            t = table[name]
            if isinstance(ref, CtxRef) and ref.field == "kv_cache" and isinstance(t, torch.Tensor):
                # Kernels index cache rows as cache + slot * width and read them with 16-byte
                # vectors / cp.async where the width allows: a contiguous, 16-byte aligned cache.
                if not t.is_contiguous() or t.data_ptr() % 16:
                    raise LaunchError(f"kernel {launch.name}: the kv_cache must be a contiguous tensor with a "
                                      f"16-byte aligned start (got strides {tuple(t.stride())}, "
                                      f"address % 16 = {t.data_ptr() % 16})")
            return t
        scalar = {"i32": I32, "i64": I64, "f32": F32}[arg.kind]
        if isinstance(ref, StrideRef):
            return scalar(int(_lookup_value(values, ref.value, launch, ref).stride(ref.dim)))
        if isinstance(ref, SizeRef):
            n = size_exprs.evaluate(ref.expr, sizes)
            return scalar(float(n) if arg.kind == "f32" else n)
        raise LaunchError(f"kernel {launch.name}: scalar argument {arg.name} binds {describe_ref(ref)}")

    def workspaces(self, launch: KernelLaunch, *, values: dict, weights: dict, ctx: dict,
                   sizes: dict) -> dict[str, torch.Tensor]:
        """The launch's workspaces at these sizes, freshly allocated."""
        return self._allocate(_Bound.make(launch, sizes, geometry_only=True), values, weights, ctx)

    @staticmethod
    def step_sizes(sizes: dict, ctx: dict, values: dict | None = None) -> dict:
        """`sizes`, with T and B filled in from ctx tensor shapes when absent (no host sync),
        and the device sizes (SMS: the SM count) from the device the tensors live on."""
        full = dict(sizes)
        if "T" not in full and isinstance(ctx.get("positions"), torch.Tensor):
            full["T"] = int(ctx["positions"].shape[0])
        if "B" not in full and isinstance(ctx.get("context_lens"), torch.Tensor):
            full["B"] = int(ctx["context_lens"].shape[0])
        if "SMS" not in full:
            sms = _sm_count(values or {}, ctx)
            if sms is not None:
                full["SMS"] = sms
        return full

    def run(self, launch: KernelLaunch, *, values: dict[str, torch.Tensor],
            weights: dict[str, torch.Tensor] | None = None, ctx: dict[str, torch.Tensor] | None = None,
            sizes: dict[str, int] | None = None, stream=None,
            workspaces: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Launch one kernel; returns its workspaces (allocated here unless given).  A launch whose
        grid is empty at these sizes (the forms a family does not use at this T: grid factors) binds
        nothing and loads no module: it would launch nothing."""
        weights, ctx = weights or {}, ctx or {}
        sizes = self.step_sizes(sizes or {}, ctx, values)
        return self._run(self._bound(launch, sizes), values, weights, ctx, sizes, _stream_handle(stream), workspaces)

    def run_all(self, launches, *, values: dict, weights: dict | None = None, ctx: dict | None = None,
                sizes: dict | None = None, stream=None, workspaces: dict | None = None) -> dict[str, torch.Tensor]:
        """Run several launches of one node in order (e.g. split-KV attention + its combine),
        sharing workspaces by name (each allocated once); returns them all."""
        weights, ctx = weights or {}, ctx or {}
        sizes = self.step_sizes(sizes or {}, ctx, values)
        stream = _stream_handle(stream)
        shared: dict[str, torch.Tensor] = dict(workspaces or {})
        for launch in launches:
            self._run(self._bound(launch, sizes), values, weights, ctx, sizes, stream, shared)
        return shared

    # -- the launch path ------------------------------------------------------
    # An eager prefill step is ~600 launches; evaluating each launch's expressions and checking each
    # argument's type anew cost ~60 us of Python a launch (more than most of prefill's kernels take
    # on the GPU).  What the step's sizes decide is worked out once per (launch, sizes) (_Bound);
    # a launch then fetches its tensors, packs, and calls the driver.

    def _bound(self, launch: KernelLaunch, sizes: dict) -> "_Bound":
        """The launch's _Bound at these sizes, kept per launch and the sizes its expressions read
        (a decode attention's split count reads the context, an RMSNorm only T); the cache starts
        over when it holds _BOUNDS_KEPT of them."""
        reads = self._reads.get(id(launch))
        if reads is None or reads[0] is not launch:
            reads = self._reads[id(launch)] = (launch, _size_names(launch))
        key = (id(launch), *(sizes.get(n) for n in reads[1]))
        bound = self._bounds.get(key)
        if bound is None or bound.launch is not launch:
            if len(self._bounds) >= _BOUNDS_KEPT:
                self._bounds.clear()
                self._reads = {id(launch): reads}   # it holds each launch it saw: keep only this one
            bound = self._bounds[key] = _Bound.make(launch, sizes)
        return bound

    def _run(self, bound: "_Bound", values: dict, weights: dict, ctx: dict, sizes: dict, stream: int,
             workspaces: dict | None) -> dict[str, torch.Tensor]:
        launch = bound.launch
        if workspaces is None:
            workspaces = {}
        if any(name not in workspaces for name, _, _ in bound.workspaces):
            for name, t in self._allocate(bound, values, weights, ctx).items():
                workspaces.setdefault(name, t)
        if bound.grid is None:
            return workspaces
        if bound.func is None:
            bound.func = self.module(launch).function(launch.name, bound.smem)
        tables = (values, weights, ctx, workspaces)
        params = []
        for i, (kind, x) in enumerate(bound.fetch):
            if kind == _CONST:
                params.append(x)
                continue
            if kind == _STRIDE:
                t = values.get(x[0])
                params.append(int(t.stride(x[1])) if t is not None else
                              self._arg(launch.args[i], launch, values, weights, ctx, workspaces, sizes).value)
                continue
            if kind == _TMAP:
                params.append(self._tensor_map(launch.args[i], launch, weights))
                continue
            t = tables[kind].get(x)
            if t is None or (kind == _CTX and x == "kv_cache") or not hasattr(t, "data_ptr"):
                t = self._arg(launch.args[i], launch, values, weights, ctx, workspaces, sizes)   # names what is wrong
                if t is None:
                    params.append(0)
                    continue
                if not hasattr(t, "data_ptr"):
                    raise LaunchError(f"kernel {launch.name}: argument {launch.args[i].name} "
                                      f"({describe_ref(launch.args[i].ref)}) is a {type(t).__name__}, not a tensor")
            if not t.is_cuda:   # a host pointer in a kernel faults and poisons the whole context
                raise LaunchError(f"kernel {launch.name}: argument {launch.args[i].name} is a {t.device} tensor; "
                                  f"kernels need CUDA tensors")
            params.append(t.data_ptr())
        from .cuda_driver import launch_packed
        launch_packed(bound.func, bound.grid, launch.block, bound.smem, (tuple(params), bound.types), stream,
                      pdl=launch.pdl and self.pdl)
        return workspaces

    def _allocate(self, bound: "_Bound", values: dict, weights: dict, ctx: dict) -> dict[str, torch.Tensor]:
        device = _device(values, weights, ctx)
        out = {}
        for name, shape, dtype in bound.workspaces:
            out[name] = torch.empty(shape, dtype=_act_dtype(values, weights) if dtype == "act" else dtype,
                                    device=device)
        return out

    def close(self) -> None:
        for mod in self._modules.values():
            mod.unload()
        self._modules.clear()
        self._tensor_maps.clear()
        self._bounds.clear()
        self._reads.clear()


def manifest_kernels(bundle_dir: str | Path) -> list[str]:
    """Kernel names a bundle's manifest lists (no validation; see codegen.bundle.load_manifest)."""
    manifest = json.loads((Path(bundle_dir) / "manifest.json").read_text(encoding="utf-8"))
    return sorted(manifest.get("kernels", {}))
