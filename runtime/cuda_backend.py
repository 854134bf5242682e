"""The `cuda` backend: run a bundle's manifest on torch tensors.

A bundle (made by `dsgraph compile`, or compiled here through the cache when none is
given) is the artifact: `open_bundle` checks it against this dsgraph and this GPU and
reads back each phase's plan from its manifest; the backend then runs those steps as
written, with no graph, no passes, no lowering and no NVRTC.  Each step places its
values and workspaces in its phase's arena per the memory plan (codegen/memplan.py: values
whose lifetimes do not overlap share bytes), binds them to the kernels' typed arguments, and
launches on torch's current stream; dense GEMMs above the skinny kernel's token count (cuBLAS through torch),
the views of ``split`` and, in a rank's bundle, the all-reduce and the local-expert renumbering are
the only library calls.  No
device-to-host copy happens in a step.

Under tensor / expert parallelism (tp = world > 1) one bundle holds every rank's plan
(codegen/bundle.py); each process loads its rank's, the ranks check that they loaded the same
bundle (its key), and each binds its slices of the weights as the rank's manifest lists them.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from codegen import sizes as size_exprs
from codegen.kernel import DEFAULTS, KernelLaunch, LibraryCall, ValueRef
from codegen.memplan import ArenaPlan, workspace_slot
from ir.context import StepContext
from ir.formats import FORMATS, FP8, companion_names, dequantize
from ir.formats_int import IntMatrix
from ir.ops.collective import all_reduce_sum
from ir.ops.core import gate_up_silu_ref
from ir.ops.moe import local_experts_ref, pairs_per_token

from .errors import InputError
from .h2d import upload
from .launcher import KernelRunner

_LAYOUTS_KEPT = 64   # (phase, sizes) layouts kept before the cache starts over
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_VALUE_DTYPES = {"f32": torch.float32, "i64": torch.int64, "i32": torch.int32}

INT8_CHANNEL = FORMATS["int8_channel"]   # msModelSlim W8A8_DYNAMIC: its library calls run int_linear


def _node_of(step) -> str:
    return step.nodes[0] if isinstance(step, KernelLaunch) else step.node


def check_cuda_device(device) -> torch.device:
    """The device, if it is a CUDA device this process can use (checked before any weight is read)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise InputError(f"backend='cuda' needs a CUDA device, got device={device} "
                         f"(CUDA available: {torch.cuda.is_available()})")
    return device


def device_arch_of(device: torch.device) -> str:
    """The SM architecture of `device` (sm_90 on H100/H200), as NVRTC names it."""
    from .cuda_driver import device_arch
    with torch.cuda.device(device):
        return device_arch()


def open_bundle(spec, *, bundle_dir=None, device, dtype: torch.dtype | None, block_size: int | None,
                cache_dir=None, world: int = 1, rank: int = 0, pdl: bool | None = None, tuning=None):
    """The LoadedBundle to run on `device`: `bundle_dir` as given, or `spec` compiled for this
    GPU through the bundle cache (with dsgraph's defaults for what is not given; the target is
    codegen.arch.target_arch of the device).  Either way it is checked (compiler hash, key, that its
    target runs on this device, NVRTC, and dtype / block size / pdl where given) and read back
    from its manifest: one path for both.  As rank `rank` of `world` (world > 1, the process group
    up): the bundle must be one compiled for `world` ranks, the plans are this rank's, and every
    rank must have loaded the same bundle (its key, gathered over the group; ParallelError if not)."""
    from codegen.arch import target_arch
    from codegen.bundle import compile_bundle, load_bundle
    from codegen.nvrtc import nvrtc_version

    from .parallel import agree_after
    device = check_cuda_device(device)
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise InputError(f"backend='cuda' runs bf16, fp16 or fp32, got {dtype}")
    arch = device_arch_of(device)
    name = DTYPE_NAMES[dtype] if dtype is not None else None
    loaded, failure = None, None
    try:
        if bundle_dir is None:
            # dsgraph compile's default target where this device runs it (codegen/arch.py): one set
            # of defaults, one cache entry
            bundle_dir = compile_bundle(spec, arch=target_arch(arch), dtype=name or DEFAULTS.dtype,
                                        block_size=block_size or DEFAULTS.block_size, cache_dir=cache_dir,
                                        world=world, pdl=DEFAULTS.pdl if pdl is None else pdl,
                                        tuning=tuning).path
        loaded = load_bundle(bundle_dir, arch=arch, nvrtc_version=nvrtc_version(), dtype=name,
                             block_size=block_size, world=world, rank=rank, pdl=pdl)
    except Exception as exc:   # any failure: the other ranks must not be left waiting in the all-gather
        if world == 1:
            raise
        failure = exc
    if world > 1:
        agree_after("bundle key", loaded.key if loaded is not None else "", failure)
    return loaded


def plans_pairs_per_token(plans: dict, top_k: int) -> int:
    """P of the plans' routing values (shape ("T*P", experts)); `top_k` where no phase routes.
    Every phase must agree: NP is one size of the step."""
    found = set()
    for plan in plans.values():
        for buf in plan.buffers.values():
            if buf.dtype == "routing":
                P = pairs_per_token(buf.shape[0])
                if P is None or str(buf.shape[0]) != f"T*{P}":
                    raise InputError(f"a routing buffer {buf.name} has {buf.shape[0]!r} rows; this runtime "
                                     f"reads 'T*P'")
                found.add(P)
    if len(found) > 1:
        raise InputError(f"the bundle's phases route {sorted(found)} pairs a token; NP must be one size")
    return found.pop() if found else top_k


class CudaBackend:
    name = "cuda"
    # Whether the engine may run decode tokens inside a prefill chunk's step (Engine._mixed_step).  Not
    # here: a token in a prefill step attends through the context gather and kv_b decompression of its
    # sequence's whole context (context x H x (N + V) per layer: at 256 sequences of 8k context, 2M rows
    # of 8 KB of keys and values in V2-Lite), where a decode step reads the compressed rows as they
    # are; so a mixed step runs its decode tokens as a decode step (its CUDA graph) beside the chunk.
    mixed_steps = False

    def __init__(self, plans: dict, weights: dict, runner, *, dtype, top_k: int):
        self.plans = plans            # phase -> codegen.plan.PhasePlan, read from the manifest
        self.weights = weights
        self.runner = runner          # KernelRunner (or a stand-in with run_all)
        self.dtype = dtype
        # token-expert pairs a token (the size NP = T * this): the plans' routing says, since
        # ir/passes/fuse_shared_experts.py adds the shared experts' pairs to the top_k routed ones
        self.pairs_per_token = plans_pairs_per_token(plans, top_k)
        self.use_graphs = True        # steps replay CUDA graphs (turn off to launch every step eagerly)
        self._schedules: dict[str, list] = {}   # phase -> its steps by node (_schedule)
        self._placed_first: dict[tuple, tuple] = {}   # (phase, node) -> values placed before its launches
        self._layouts: dict[tuple, dict] = {}     # (phase, sizes its buffers read) -> name -> _layout
        self._buffer_sizes: dict[str, tuple] = {}  # phase -> the size names its buffer plan reads
        self.arena_plans = {phase: ArenaPlan(plan.arena) for phase, plan in plans.items()}
        self.arenas: dict[str, torch.Tensor] = {}   # phase -> its arena (bytes), grown as steps need
        self._typed: dict[str, dict] = {}            # phase -> its arena's typed views (_arena_view)
        from .cuda_graphs import DecodeGraphs, PrefillGraphs
        self.graphs_decode = DecodeGraphs(self)
        self.graphs_prefill = PrefillGraphs(self)

    @classmethod
    def from_bundle(cls, loaded, weights: dict, *, dtype, top_k: int) -> "CudaBackend":
        unknown = sorted({s.op for p in loaded.plans.values() for s in p.library_calls} - set(LIBRARY_OPS))
        if unknown:
            raise InputError(f"bundle {loaded.path} asks for library calls this runtime does not run: "
                             f"{', '.join(unknown)}")
        backend = cls(loaded.plans, weights, KernelRunner.from_bundle(loaded), dtype=dtype, top_k=top_k)
        # A rank's decode step launches eagerly until a multi-GPU machine has tested capturing
        # its all-reduces (see _all_reduce); set use_graphs = True to try it there.
        backend.use_graphs = loaded.world == 1
        return backend

    # ---- one step ----------------------------------------------------------------------------
    def _sizes(self, ctx: StepContext) -> dict:
        T = ctx.num_tokens
        return {"T": T, "B": ctx.num_seqs, "NP": T * self.pairs_per_token, "MAXQ": max(ctx.query_lens),
                "MAXCTX": max(ctx.context_lens), "TK": sum(ctx.context_lens), "W": int(ctx.block_tables.shape[1])}

    def _shape(self, shape, sizes) -> tuple:
        return tuple(size_exprs.evaluate(d, sizes) if isinstance(d, str) else d for d in shape)

    def _layout(self, name: str, plan, sizes: dict, shapes: dict, placed):
        """What the buffer plan says of `name` at these sizes, worked out once per sizes (`shapes`
        is that sizes' cache, `placed` the arena's codegen.memplan.Layout at them): ("state", layer)
        | ("routing", parts) | ("view", base, shape, strides, offset) | ("arena", byte offset, shape,
        dtype) | ("new", shape, dtype): a value the memory plan leaves out (the step's outputs)."""
        got = shapes.get(name)
        if got is None:
            buf = plan.buffers[name]
            if name in placed.offsets:
                got = ("arena", placed.offsets[name], self._shape(buf.shape, sizes),
                       self.dtype if buf.dtype == "act" else _VALUE_DTYPES[buf.dtype])
            elif buf.dtype == "state":
                got = ("state", buf.layer)
            elif buf.dtype == "routing":
                got = ("routing", tuple(buf.parts))
            elif buf.view is not None:
                got = ("view", buf.view.base, self._shape(buf.shape, sizes), self._shape(buf.view.strides, sizes),
                       buf.view.offset)
            else:
                got = ("new", self._shape(buf.shape, sizes),
                       self.dtype if buf.dtype == "act" else _VALUE_DTYPES[buf.dtype])
            shapes[name] = got
        return got

    def _shapes_at(self, phase: str, sizes: dict, arena_key: tuple) -> dict:
        """The layout cache of `phase` at these sizes, keyed by the sizes its buffer plan reads (a
        decode step's growing context reads none of them, so eager decode hits it every step) and
        the arena's placement (ArenaPlan.key); emptied when it holds _LAYOUTS_KEPT of them (a
        server's prompts have many lengths)."""
        names = self._buffer_sizes.get(phase)
        if names is None:
            names = set()
            for buf in self.plans[phase].buffers.values():
                for d in (*buf.shape, *(buf.view.strides if buf.view is not None else ())):
                    names |= size_exprs.names(d)
            names = self._buffer_sizes[phase] = tuple(sorted(names))
        key = (phase, arena_key, *(sizes.get(n) for n in names))
        shapes = self._layouts.get(key)
        if shapes is None:
            if len(self._layouts) >= _LAYOUTS_KEPT:
                self._layouts.clear()
            shapes = self._layouts[key] = {}
        return shapes

    def _workspaces(self, node: str, launches, sizes: dict, shapes: dict, placed) -> list:
        """(name, (byte offset, shape, dtype)) of the node's workspaces in the arena, worked out once
        per sizes (a name its launches share once, as KernelRunner.run_all allocates it; one empty
        at these sizes is left to the runner)."""
        key = ("workspaces", node)
        got = shapes.get(key)
        if got is None:
            got, seen = [], set()
            for launch in launches:
                for ws in launch.workspace:
                    slot = workspace_slot(node, ws.name)
                    if ws.name not in seen and placed.nbytes.get(slot):
                        dtype = self.dtype if ws.dtype == "act" else _VALUE_DTYPES[ws.dtype]
                        got.append((ws.name, (placed.offsets[slot], self._shape(ws.shape, sizes), dtype)))
                    seen.add(ws.name)
            shapes[key] = got
        return got

    def _materialize(self, name: str, plan, env: dict, sizes: dict, ctx: StepContext, device, shapes: dict,
                     placed, arena: dict) -> None:
        if name in env:
            return
        got = self._layout(name, plan, sizes, shapes, placed)
        if got[0] == "arena":
            env[name] = _arena_view(arena, got[1], got[2], got[3])
        elif got[0] == "new":
            env[name] = torch.empty(got[1], dtype=got[2], device=device)
        elif got[0] == "view":
            _, base_name, shape, strides, offset = got
            self._materialize(base_name, plan, env, sizes, ctx, device, shapes, placed, arena)
            base = env[base_name]
            env[name] = base.as_strided(shape, strides, base.storage_offset() + offset)
        elif got[0] == "state":
            env[name] = ctx.kv_cache[got[1]]
        else:
            for part in got[1]:
                self._materialize(part, plan, env, sizes, ctx, device, shapes, placed, arena)
            env[name] = {"order": env[got[1][0]], "offsets": env[got[1][1]]}

    def _meta(self, ctx: StepContext, device) -> dict:
        starts = list(itertools.accumulate(ctx.query_lens, initial=0))
        return {
            "positions": ctx.positions, "slot_mapping": ctx.slot_mapping,
            "block_tables": ctx.block_tables.to(device=device, dtype=torch.int32),
            "context_lens": upload(ctx.context_lens, torch.int32, device),
            "query_start": upload(starts, torch.int32, device),
            "key_start": upload(ctx.key_starts(), torch.int32, device),
        }

    def decode_inputs(self, B: int, W: int, device):
        """The buffers (cuda_graphs.DecodeInputs) a decode step of B sequences and block-table width W
        replays its graph on, for the engine to write the step's inputs into; None where decode
        steps launch eagerly (graphs off, or not a GPU)."""
        if not self.use_graphs or torch.device(device).type != "cuda":
            return None
        return self.graphs_decode.inputs(B, W, device)

    def forward(self, phase: str, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """ids [T] -> logits [T, vocab] float32 (or [L, vocab]: the rows ctx.logit_rows names).
        Decode steps replay a CUDA graph per shape bucket; other steps one per shape seen before
        (cuda_graphs.PrefillGraphs).  A prefill step's sequences may hold cache rows already (a
        later chunk of a long prompt, a decode token in a mixed step): its attention gathers each
        sequence's whole context from the cache (ir/passes/lower_mla_prefill.py)."""
        if self.use_graphs and ids.is_cuda:
            if phase == "decode" and ctx.logit_rows is None and all(q == 1 for q in ctx.query_lens):
                return self.graphs_decode.run(ids, ctx)
            if phase != "decode":
                out = self.graphs_prefill.run(phase, ids, ctx)
                if out is not None:
                    return out
        return self._forward(phase, ids, ctx, self._meta(ctx, ids.device), self._sizes(ctx))

    def _schedule(self, phase: str) -> list:
        """The phase's steps by node, in order: (node, its launches, its library call or None), made
        once per phase.  A node's steps are consecutive: its launches (sharing workspaces), one
        library call, or both (a linear: the launches below call.from_tokens tokens, the library
        call from there on; T is known on the host, so a captured decode graph holds exactly one
        of them)."""
        sched = self._schedules.get(phase)
        if sched is None:
            sched = []
            for node, group in itertools.groupby(self.plans[phase].steps, key=_node_of):
                steps = list(group)
                call = steps[-1] if isinstance(steps[-1], LibraryCall) else None
                sched.append((node, [s for s in steps if isinstance(s, KernelLaunch)], call))
            self._schedules[phase] = sched
        return sched

    def _forward(self, phase: str, ids: torch.Tensor, ctx: StepContext, meta: dict, sizes: dict,
                 as_float: bool = True) -> torch.Tensor:
        """The step's logits, float32 (as_float) or in the head's own dtype (a captured graph's
        output: cuda_graphs converts it once per replay, into a tensor of the caller's)."""
        plan = self.plans[phase]
        device = ids.device
        env = {"ids": ids}
        sizes = KernelRunner.step_sizes(sizes, meta, env)   # once a step (the device's SM count too)
        arena_plan = self.arena_plans[phase]
        arena_key = arena_plan.key(sizes, self.dtype.itemsize)
        placed = arena_plan.layout(sizes, self.dtype.itemsize, arena_key)
        arena = self._arena(phase, placed.total, device)
        shapes = self._shapes_at(phase, sizes, arena_key)
        for node, launches, call in self._schedule(phase):
            if call is not None and launches and not call.runs_at(sizes["T"]):
                call = None   # the kernels' turn
            if call is not None and call.op == "linear" and "logits" in call.outputs:
                self._linear(call, env, rows=ctx.logit_rows)   # the head: only the rows used, a new tensor
                continue
            info = plan.nodes[node]
            for out in self._outputs(phase, node, launches):
                self._materialize(out, plan, env, sizes, ctx, device, shapes, placed, arena)
            if call is not None:
                if call.op in _ALLOCATING:
                    _ALLOCATING[call.op](self, call, env)   # into the planned outputs
                continue   # else a view: the buffer plan made it
            meta["kv_cache"] = ctx.kv_cache[info.layer] if info.layer is not None else None
            work = {name: _arena_view(arena, *where)
                    for name, where in self._workspaces(node, launches, sizes, shapes, placed)}
            self.runner.run_all(launches, values=env, weights=self.weights, ctx=meta, sizes=sizes,
                                workspaces=work)
            if ctx.logit_rows is not None and "logits" in info.outputs:   # a kernel made them: all rows
                env["logits"] = env["logits"].index_select(0, ctx.logit_rows)
        return env["logits"].float() if as_float else env["logits"]

    def _outputs(self, phase: str, node: str, launches) -> tuple[str, ...]:
        """The values to place before a node's launches run: its outputs, and where a launch serves
        several nodes (a persistent segment, codegen/segments.py) every member's outputs and the views
        its members read, which their own nodes' turns would make only after it.  Made once a node."""
        key = (phase, node)
        got = self._placed_first.get(key)
        if got is None:
            plan = self.plans[phase]
            names = list(plan.nodes[node].outputs)
            for launch in launches:
                if len(launch.nodes) > 1:
                    names += [o for n in launch.nodes for o in plan.nodes[n].outputs]
                    names += [a.ref.name for a in launch.args if isinstance(a.ref, ValueRef)
                              and a.ref.name in plan.buffers]
            got = self._placed_first[key] = tuple(dict.fromkeys(names))
        return got

    def _linear(self, call: LibraryCall, env: dict, rows: torch.Tensor | None = None) -> None:
        """x @ w.T through cuBLAS, one GEMM per weight (a multi_linear has several); `rows`
        (StepContext.logit_rows): on those rows of x alone."""
        x = env[call.inputs[0]]
        if rows is not None:
            x = x.index_select(0, rows)
        if call.attrs.get("precision") == "fp32":
            x = x.float()
        for name, out in zip(call.weights, call.outputs, strict=True):
            w = self._library_weight(call, name, x.dtype)
            if isinstance(w, IntMatrix):
                _put(env, out, w.linear(x))
                continue
            if call.attrs.get("precision") == "fp32":
                w = w.float()
            dst = env.get(out)
            if dst is not None and x.dim() == 2 and dst.dtype == x.dtype == w.dtype and dst.is_contiguous() \
                    and tuple(dst.shape) == (x.shape[0], w.shape[0]):
                torch.mm(x, w.t(), out=dst)   # F.linear's own GEMM, into the planned buffer
            else:
                _put(env, out, F.linear(x, w))

    def _library_weight(self, call: LibraryCall, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A library call's weight as cuBLAS takes it.  FP8 weights reach a library call only where the
        FP8 GEMM cannot run (a target without sm_90a, K % 16 != 0: codegen/dispatch.py's linear table):
        dequantised to the activation dtype every call -- correct, not fast."""
        w = self.weights[name]
        if call.attrs.get("weight_format") == FP8.name:
            w = dequantize(w, [self.weights[c] for c in companion_names(name, FP8)], FP8).to(dtype)
        elif call.attrs.get("weight_format") == INT8_CHANNEL.name:
            # the exact integer linear (ir/formats_int.py int_linear: x quantised per token, the integer
            # product, then the scales), which linear() / gate_up_silu_ref take as an IntMatrix; the
            # loader checked the offsets, so it reads nothing on the host (decode graphs capture it)
            w = IntMatrix(w, [self.weights[c] for c in companion_names(name, INT8_CHANNEL)], INT8_CHANNEL,
                          checked=True)
        return w

    def _gate_up_silu(self, call: LibraryCall, env: dict) -> None:
        """silu(x gate^T) * (x up^T) above the skinny kernel's token count: two cuBLAS GEMMs and
        torch's SwiGLU, rounding where the kernel (and the unfused ops) round."""
        x = env[call.inputs[0]]
        gate, up = (self._library_weight(call, w, x.dtype) for w in call.weights)
        _put(env, call.outputs[0], gate_up_silu_ref(x, gate, up))

    def _all_reduce(self, call: LibraryCall, env: dict) -> None:
        """The sum of this rank's partial value over every rank: torch.distributed (NCCL on GPUs,
        gloo on the CPU).  NCCL runs on its own stream, after the step's kernels on torch's current
        stream, which then waits for it on the device (work.wait(): no host wait).

        For this to stay inside a captured decode graph (cuda_graphs.DecodeGraphs; off for
        world > 1 until tested, see from_bundle): NCCL >= 2.9.6 (collectives on a capturing
        stream); the communicator made before the first capture (the eager prefill steps run an
        all-reduce first); the reduced buffer allocated from the graph's pool during capture
        (all_reduce_sum's copy is, so it has one address every replay); no host sync in the step
        (none here: no .item(), no barrier, and TORCH_NCCL_BLOCKING_WAIT unset, which would make
        wait() block the host); every rank capturing and replaying the same graphs in the same
        order (they do: the ranks run the same steps on the same inputs).  Untested on GPUs."""
        _put(env, call.outputs[0], all_reduce_sum(env[call.inputs[0]]))

    def _local_experts(self, call: LibraryCall, env: dict) -> None:
        ids, weights = local_experts_ref(env[call.inputs[0]], env[call.inputs[1]], call.attrs["first"],
                                         call.attrs["count"])
        _put(env, call.outputs[0], ids)
        _put(env, call.outputs[1], weights)

    # ---- the arena ---------------------------------------------------------------------------
    def _arena(self, phase: str, nbytes: int, device) -> dict:
        """The phase's arena, as one typed view per dtype, holding at least `nbytes`.  Growing it
        drops the phase's captured graphs: they hold the old arena's addresses (graphs of one phase
        share the arena: they never run at the same time)."""
        have = self.arenas.get(phase)
        if have is None or have.numel() < nbytes or have.device != torch.device(device):
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"the {phase} arena must grow during a graph capture; the capture's "
                                   f"warm-up runs the same step first, so this is a bug")
            grow = have.numel() * 5 // 4 if have is not None and have.device == torch.device(device) else 0
            if have is not None and have.is_cuda:
                # the steps queued on the old arena finish before its memory goes back to the allocator
                # (a warm-up on a side stream may allocate it next); growing is rare: a new largest step
                torch.cuda.synchronize(have.device)
            # the old arena (its views and the graphs that hold it included) is freed before the new one
            # is allocated, so growing never holds both
            have = None
            self.arenas.pop(phase, None)
            self._typed.pop(phase, None)
            self.graphs_decode.forget(phase)
            self.graphs_prefill.forget(phase)
            have = self.arenas[phase] = torch.empty(_round_arena(max(nbytes, grow)), dtype=torch.uint8,
                                                    device=device)
        typed = self._typed.get(phase)
        if typed is None:
            typed = self._typed[phase] = {"arena": have}
        return typed

    def arena_bytes(self) -> int:
        """Bytes the arenas of every phase hold now."""
        return sum(a.numel() for a in self.arenas.values())

    def release_arenas(self) -> None:
        """Free the arenas (and the graphs that hold their addresses); the next step allocates anew."""
        for phase, arena in list(self.arenas.items()):
            if arena.is_cuda:
                torch.cuda.synchronize(arena.device)
            self.graphs_decode.forget(phase)
            self.graphs_prefill.forget(phase)
        self.arenas.clear()
        self._typed.clear()


_ARENA_ROUND = 2 << 20   # grow in whole 2 MiB pages (torch's large-allocation granularity)


def _round_arena(nbytes: int) -> int:
    return max(_ARENA_ROUND, -(-nbytes // _ARENA_ROUND) * _ARENA_ROUND)


def _arena_view(arena: dict, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The contiguous `shape` of `dtype` at byte `offset` of the arena (`arena`: its typed views,
    made once per dtype; offsets are aligned to codegen.memplan.ALIGN)."""
    typed = arena.get(dtype)
    if typed is None:
        raw = arena["arena"]
        typed = arena[dtype] = raw[:raw.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return typed.as_strided(shape, tuple(reversed(strides)), offset // dtype.itemsize)


def _put(env: dict, name: str, result: torch.Tensor) -> None:
    """A library call's result into its planned buffer (or as the value, where none is planned)."""
    dst = env.get(name)
    if dst is None:
        env[name] = result
    else:
        dst.copy_(result)


# Library calls that compute their outputs (into the planned buffers, _put); `split` is the other one
# (a view the buffer plan makes).
_ALLOCATING = {"linear": CudaBackend._linear, "multi_linear": CudaBackend._linear,
               "gate_up_silu": CudaBackend._gate_up_silu, "all_reduce": CudaBackend._all_reduce,
               "moe_local_experts": CudaBackend._local_experts}
LIBRARY_OPS = (*_ALLOCATING, "split")
