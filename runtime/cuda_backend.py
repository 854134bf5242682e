"""The `cuda` backend: run a phase's launches from a compiled bundle on torch tensors.

The bundle (codegen.bundle) is compiled on this machine for this GPU (a cache hit
after the first time); the launch plan is the same lowering the manifest records.
Each step allocates its values per the buffer plan, binds them to the kernels'
arguments, and launches on torch's current stream; dense GEMMs and the views of
``split`` are the only library calls.  No device-to-host copy happens in a step.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from codegen.bundle import check_compatible, compile_bundle, load_manifest
from codegen.kernel import KernelLaunch, LibraryCall, Options
from codegen.lower import lower_graph
from codegen import sizes as size_exprs
from ir.context import StepContext

from .errors import InputError
from .h2d import upload
from .launcher import KernelRunner

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_VALUE_DTYPES = {"f32": torch.float32, "i64": torch.int64, "i32": torch.int32}


def _node_of(step) -> str:
    return step.nodes[0] if isinstance(step, KernelLaunch) else step.node


class CudaBackend:
    name = "cuda"

    def __init__(self, spec, graphs: dict, weights: dict, plans: dict, runner: KernelRunner, *, dtype, block_size):
        self.spec = spec
        self.graphs = graphs
        self.weights = weights
        self.plans = plans
        self.runner = runner
        self.dtype = dtype
        self.block_size = block_size
        self.top_k = spec.dims["top_k"]
        # node -> layer, for binding each launch to its layer's cache
        self.layer_of = {phase: {n: d.get("layer") for n, d in G.nodes(data=True)} for phase, G in graphs.items()}
        self.outputs_of = {phase: {n: list(d["outputs"]) for n, d in G.nodes(data=True)} for phase, G in graphs.items()}
        self.use_graphs = True   # decode steps replay CUDA graphs (turn off to launch eagerly)
        from .cuda_graphs import DecodeGraphs
        self.graphs_decode = DecodeGraphs(self)

    @classmethod
    def create(cls, spec, graphs, weights, *, device, dtype, block_size: int = 16, bundle_dir=None, arch=None,
               cache_dir=None) -> "CudaBackend":
        from codegen.nvrtc import nvrtc_version
        from .cuda_driver import device_arch
        device = torch.device(device)
        if device.type != "cuda" or not torch.cuda.is_available():
            raise InputError(f"backend='cuda' needs a CUDA device, got device={device} "
                             f"(CUDA available: {torch.cuda.is_available()})")
        if dtype not in _DTYPE_NAMES:
            raise InputError(f"backend='cuda' runs bf16, fp16 or fp32, got {dtype}")
        with torch.cuda.device(device):
            arch = arch or device_arch()
        if bundle_dir is None:
            bundle_dir = compile_bundle(spec, arch=arch, dtype=_DTYPE_NAMES[dtype], block_size=block_size,
                                        cache_dir=cache_dir).path
        manifest = load_manifest(bundle_dir)
        check_compatible(manifest, arch, nvrtc_version())
        opts = manifest.get("options", {})
        if opts.get("dtype") != _DTYPE_NAMES[dtype] or opts.get("block_size") != block_size:
            raise InputError(f"bundle {bundle_dir} was compiled for dtype={opts.get('dtype')} "
                             f"block_size={opts.get('block_size')}; the engine runs {_DTYPE_NAMES[dtype]} "
                             f"with block_size={block_size}")
        lowering = Options(arch=arch, dtype=_DTYPE_NAMES[dtype], block_size=block_size)
        plans = {phase: lower_graph(G, lowering) for phase, G in graphs.items()}
        runner = KernelRunner.from_bundle(bundle_dir)
        missing = sorted({l.name for p in plans.values() for l in p.launches} - set(manifest["kernels"]))
        if missing:
            raise InputError(f"bundle {bundle_dir} lacks kernels {missing[:5]}: it was compiled from another "
                             f"spec; recompile it")
        return cls(spec, graphs, weights, plans, runner, dtype=dtype, block_size=block_size)

    # ---- one step ----------------------------------------------------------------------------
    def _sizes(self, ctx: StepContext) -> dict:
        T = ctx.num_tokens
        return {"T": T, "B": ctx.num_seqs, "NP": T * self.top_k, "MAXQ": max(ctx.query_lens),
                "MAXCTX": max(ctx.context_lens), "W": int(ctx.block_tables.shape[1])}

    def _shape(self, shape, sizes) -> tuple:
        return tuple(size_exprs.evaluate(d, sizes) if isinstance(d, str) else d for d in shape)

    def _materialize(self, name: str, plan, env: dict, sizes: dict, ctx: StepContext, device) -> None:
        if name in env:
            return
        buf = plan.buffers[name]
        if buf.dtype == "state":
            env[name] = ctx.kv_cache[buf.layer]
        elif buf.dtype == "routing":
            for part in buf.parts:
                self._materialize(part, plan, env, sizes, ctx, device)
            env[name] = {"order": env[buf.parts[0]], "offsets": env[buf.parts[1]]}
        elif buf.view is not None:
            self._materialize(buf.view.base, plan, env, sizes, ctx, device)
            base = env[buf.view.base]
            shape = self._shape(buf.shape, sizes)
            strides = self._shape(buf.view.strides, sizes)
            env[name] = base.as_strided(shape, strides, base.storage_offset() + buf.view.offset)
        else:
            dtype = self.dtype if buf.dtype == "act" else _VALUE_DTYPES[buf.dtype]
            env[name] = torch.empty(self._shape(buf.shape, sizes), dtype=dtype, device=device)

    def _meta(self, ctx: StepContext, device) -> dict:
        starts = list(itertools.accumulate(ctx.query_lens, initial=0))
        return {
            "positions": ctx.positions, "slot_mapping": ctx.slot_mapping,
            "block_tables": ctx.block_tables.to(device=device, dtype=torch.int32),
            "context_lens": upload(ctx.context_lens, torch.int32, device),
            "query_start": upload(starts, torch.int32, device),
        }

    def forward(self, phase: str, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """ids [T] -> logits [T, vocab] float32.  Decode steps replay a CUDA graph per shape bucket."""
        if phase == "decode" and self.use_graphs and all(q == 1 for q in ctx.query_lens):
            return self.graphs_decode.run(ids, ctx)
        return self._forward(phase, ids, ctx, self._meta(ctx, ids.device), self._sizes(ctx))

    def _forward(self, phase: str, ids: torch.Tensor, ctx: StepContext, meta: dict, sizes: dict) -> torch.Tensor:
        plan = self.plans[phase]
        device = ids.device
        env = {"ids": ids}
        layer_of, outputs_of = self.layer_of[phase], self.outputs_of[phase]
        # A node's steps are consecutive: its launches (sharing workspaces), or one library call.
        for node, group in itertools.groupby(plan.steps, key=_node_of):
            steps = list(group)
            call = steps[0] if isinstance(steps[0], LibraryCall) else None
            if call is not None and call.call != "view":
                self._library(self.graphs[phase], call, env)   # the library allocates its outputs
                continue
            for out in outputs_of[node]:
                self._materialize(out, plan, env, sizes, ctx, device)
            if call is not None:
                continue   # a view: the buffer plan made it
            layer = layer_of[node]
            meta["kv_cache"] = ctx.kv_cache[layer] if layer is not None else None
            self.runner.run_all(steps, values=env, weights=self.weights, ctx=meta, sizes=sizes)
        return env["logits"].float()

    def _library(self, G, call: LibraryCall, env: dict) -> None:
        if call.op == "linear":
            x = env[call.inputs[0]]
            w = self.weights[call.weights[0]]
            if call.attrs.get("precision") == "fp32":
                env[call.outputs[0]] = F.linear(x.float(), w.float())
            else:
                env[call.outputs[0]] = F.linear(x, w)
            return
        from ir.ops import OPS
        from ir.graph import node_view
        node = node_view(G, call.node)
        w = {role: self.weights[name] for role, name in G.nodes[call.node]["weights"].items()}
        outs = OPS[call.op].run(node, [env[v] for v in call.inputs], w, None)
        env.update(zip(call.outputs, outs))
