"""Sizing a multi-GPU deployment before it exists: per-GPU memory, bytes per decode step, all-reduce
volume and a roofline estimate of the step time, for N tensor/expert-parallel GPUs.

How each figure is derived (B batch, L context, N GPUs, L_m layers, E routed experts, K top-k,
D hidden, W = kv_lora_rank + qk_rope_head_dim the latent cache row, elt the dtype's bytes):

  weights / GPU   every weight the graphs bind (runtime.model_loader.weight_specs: the engine's own
                  list), cut to rank 0's part by ir/parallel.py (the one table of how each weight is
                  split), summed by runtime.memory.weight_bytes (routers stay float32; a weight the
                  spec stores quantised counts as stored: FP8 one byte an element, plus its scales).  Rank 0 is
                  every rank: heads, widths and experts split evenly, the rest is replicated.
  KV cache / GPU  B sequences x ceil(L / block) pages x PagedLatentCache.bytes_per_block.  The MLA
                  latent cache is not split by heads, so every rank holds all of it: more GPUs free
                  room for it (smaller weight slices) but do not divide it.
  fits            weights + KV + runtime.memory's margin (a step's activations, allocator slack)
                  <= the GPU's memory; the largest batch at L and context at B use what is left, and
                  so does the count of sequences of the model's whole context (max_positions).
  activations     (--memory) a step's planned activation bytes (codegen/memplan.py: values share an
                  arena by liveness) for prefills of 1 / 2048 / 16384 tokens and decode batches at L,
                  from the spec lowered for one GPU.
  bytes / step    what rank 0 reads to decode one token per sequence: its slice of every weight
                  read whole (attention, dense and shared FFN, routers, norms, lm_head), B rows of
                  the embedding, the routed experts the batch touches and the KV cache (B x L x W x
                  elt x layers).  Touched experts assume uniform routing: each token picks K of E
                  experts, so an expert is untouched with probability (1 - K/E)^B and a rank's E/N
                  experts expect E/N x (1 - (1 - K/E)^B) touched (runtime/bench.py counts the same).
                  Real routing is skewed, which touches fewer distinct experts but loads one rank
                  more than the others; the even split is the optimistic case.
  all-reduce      ir/parallel.py's recipe all-reduces [B, D] activations twice a layer (after
                  o_proj, after the FFN).  A ring all-reduce sends 2 (N-1)/N of the message per GPU.
  step time       bytes / (copy bandwidth x achieved fraction) + per all-reduce (latency + volume /
                  link bandwidth); no overlap between the two, tokens/s = B / step.
                  Measured (runtime/bench_h200.json, or --bench from `dsgraph bench` on your GPU):
                  the copy bandwidth and the fraction of it dsgraph's decode step reached, taken
                  from the measured case nearest to (B, L).  Those cases are DeepSeek-V2-Lite on one
                  GPU reading 5-47 GB a step; a rank that reads much less spends more of its step in
                  launch gaps, so the estimate is optimistic there.
                  Assumed (options): the link within a node of GPUS_PER_NODE GPUs, NVLink, at
                  NVLINK_GBPS (80% of the H200's 450 GB/s per direction) and NVLINK_LATENCY_US per
                  all-reduce; beyond one node the ring's slowest hop is the network, NET_GBPS per
                  GPU (80% of a 400 Gb/s InfiniBand NDR port) and NET_LATENCY_US.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .errors import InputError

DEFAULT_GPUS = (1, 2, 4, 8, 16, 32, 64)
ALLREDUCES_PER_LAYER = 2          # ir/parallel.py: after o_proj and after the FFN
GPU_MEM_GB = 141.0                # an H200's HBM3e, as NVIDIA sells it (decimal GB)
GPUS_PER_NODE = 8                 # an HGX H200 board
NVLINK_GBPS = 360.0               # assumed effective; nominal 450 GB/s per direction
NET_GBPS = 40.0                   # assumed effective; nominal 50 GB/s (400 Gb/s NDR) per GPU
NVLINK_LATENCY_US = 10.0          # assumed: one small NCCL all-reduce within a node
NET_LATENCY_US = 25.0             # assumed: one small NCCL all-reduce across nodes
MEASURED = Path(__file__).with_name("bench_h200.json")
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    """What the estimate assumes of each GPU and its links (bandwidths in bytes/s, latency in s)."""
    gpu_mem: float
    copy_bw: float                 # measured
    bw_fraction: float             # measured (or given)
    fraction_source: str           # which measurement (or "given")
    link_bw: float = NVLINK_GBPS * GB
    net_bw: float = NET_GBPS * GB
    link_latency: float = NVLINK_LATENCY_US * 1e-6
    net_latency: float = NET_LATENCY_US * 1e-6
    gpus_per_node: int = GPUS_PER_NODE
    measured_on: str = ""


@dataclass(frozen=True)
class Plan:
    """One degree of parallelism, per GPU.  Sizes in bytes, times in ms."""
    gpus: int
    weights: int
    kv_cache: int
    margin: int
    free: int                      # gpu_mem - weights - kv_cache - margin (< 0: does not fit)
    fits: bool
    max_batch: int                 # at the requested context
    max_context: int               # at the requested batch (capped at the model's max_positions)
    full_context_seqs: int         # sequences of the model's whole context (max_positions) the KV room holds
    read: dict                     # bytes one decode step reads, by part, and "total"
    allreduce_bytes: float         # sent per GPU per step
    memory_ms: float               # read["total"] / (copy bandwidth x fraction)
    allreduce_ms: float
    step_ms: float
    tokens_per_s: float


def rank_weight_specs(specs: dict, model, world: int, rank: int = 0) -> dict:
    """The WeightSpecs rank `rank` of `world` binds: each weight cut by ir/parallel.py, a quantised
    weight's scales with it (a ParallelError where a rank's slice would split a scale's block, as
    ir/passes/shard_for_rank.py refuses it)."""
    from ir.formats import FORMATS, block_slice_problem, companion_names
    from ir.parallel import ParallelError, Shard, sharded_shape, weight_shard
    from .weights import WeightSpec
    base_of = {c: name for name, s in specs.items() if s.format
               for c in companion_names(name, FORMATS[s.format])}
    out = {}
    for name, s in specs.items():
        base = base_of.get(name, name)
        shard = weight_shard(base, specs[base].shape, model, world, rank)
        if base != name and shard.dim is not None:     # the blocks of the weight's slice
            fmt = FORMATS[specs[base].format]
            if fmt.block is None:
                raise ParallelError(f"weight {base} ({fmt.name}) on {world} ranks: integer weights run on one GPU only")
            whole = specs[base].shape[shard.dim]
            problem = block_slice_problem(fmt, shard.dim, shard.start, shard.stop, whole)
            if problem:
                raise ParallelError(f"weight {base} {specs[base].shape} ({fmt.name}) on {world} ranks: rank "
                                    f"{rank}'s slice {problem}")
            b = fmt.block[shard.dim]
            shard = Shard(shard.kind, shard.start // b, -(-shard.stop // b))
        out[name] = WeightSpec(shape=sharded_shape(s.shape, shard), keep_fp32=s.keep_fp32, format=s.format)
    return out


def gathered_weights(graphs: dict) -> set[str]:
    """Weights a decode step reads a row per token of (the embedding), not whole."""
    return {w for G in graphs.values() for _, d in G.nodes(data=True) if d["op"] == "embedding"
            for w in d["weights"].values()}


def decode_read_bytes(spec, specs: dict, gathered: set, world: int, dtype, batch: int, context: int) -> dict:
    """Bytes rank 0 of `world` reads in one decode step of `batch` sequences at `context` (module doc)."""
    from ir.parallel import rule_for
    from .memory import weight_bytes
    d = spec.dims
    # The share of a rank's experts the batch is expected to hit (no MoE layer: no expert weights either).
    touched = 1 - (1 - d["top_k"] / d["experts"]) ** batch if d["experts"] else 0.0
    whole, experts, rows = {}, 0.0, 0
    for name, s in rank_weight_specs(specs, spec.model, world).items():
        one = {name: s}
        if rule_for(name) == ("experts",):
            experts += weight_bytes(one, dtype) * touched
        elif name in gathered:
            rows += weight_bytes(one, dtype) // s.shape[0] * min(batch, s.shape[0])
        else:
            whole.update(one)
    cache = batch * context * spec.model.cache_width * dtype.itemsize * d["layers"]
    parts = {"weights": weight_bytes(whole, dtype), "routed_experts": experts, "embedding": rows, "kv_cache": cache}
    parts["total"] = sum(parts.values())
    return parts


def kv_cache_bytes(spec, dtype, batch: int, context: int, block_size: int) -> int:
    from .kv_cache import PagedLatentCache
    per_block = PagedLatentCache.bytes_per_block(spec.dims["layers"], block_size, spec.model.cache_width, dtype)
    return batch * math.ceil(context / block_size) * per_block


def allreduce_cost(spec, dtype, world: int, batch: int, hw: Hardware) -> tuple[float, float]:
    """(bytes sent per GPU, seconds) of one decode step's all-reduces on a ring of `world` GPUs."""
    if world == 1:
        return 0.0, 0.0
    count = ALLREDUCES_PER_LAYER * spec.dims["layers"]
    sent = count * 2 * (world - 1) / world * batch * spec.dims["hidden"] * dtype.itemsize
    one_node = world <= hw.gpus_per_node
    bw, latency = (hw.link_bw, hw.link_latency) if one_node else (hw.net_bw, hw.net_latency)
    return sent, sent / bw + count * latency


def plan_for(spec, specs: dict, gathered: set, world: int, *, dtype, batch: int, context: int,
             hw: Hardware, block_size: int) -> Plan:
    """The plan for `world` GPUs (a degree ir.parallel accepts)."""
    from .memory import MemoryEstimate, weight_bytes
    weights = weight_bytes(rank_weight_specs(specs, spec.model, world), dtype)
    est = MemoryEstimate(weights, kv_cache_bytes(spec, dtype, batch, context, block_size), dtype)
    room = hw.gpu_mem - weights - est.margin                  # what the KV cache may use
    max_batch = max(0, int(room // kv_cache_bytes(spec, dtype, 1, context, block_size)))
    pages = max(0, int(room // kv_cache_bytes(spec, dtype, batch, block_size, block_size)))
    max_context = min(pages * block_size, spec.dims["max_positions"])
    full = max(0, int(room // kv_cache_bytes(spec, dtype, 1, spec.dims["max_positions"], block_size)))
    fits = est.total <= hw.gpu_mem
    read = decode_read_bytes(spec, specs, gathered, world, dtype, batch, context)
    sent, ar_s = allreduce_cost(spec, dtype, world, batch, hw)
    mem_s = read["total"] / (hw.copy_bw * hw.bw_fraction)
    step_s = mem_s + ar_s
    return Plan(world, weights, est.kv_cache, est.margin, int(hw.gpu_mem - est.total), fits, max_batch, max_context,
                full, read, sent, mem_s * 1e3, ar_s * 1e3, step_s * 1e3, batch / step_s)


# -- the measured single-GPU figures ------------------------------------------------------

def load_measured(path=None) -> dict:
    """A `dsgraph bench` result (default: the H200 run shipped with dsgraph)."""
    path = Path(path) if path is not None else MEASURED
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"no measured figures at {path}: pass --bench FILE written by `dsgraph bench` "
                         f"on your GPU") from None
    except (OSError, ValueError) as e:
        raise InputError(f"cannot read the measured figures {path}: {e}") from None
    cases = data.get("decode") if isinstance(data, dict) else None
    if not isinstance(data.get("copy_bandwidth_GBps") if cases else None, (int, float)) or not all(
            isinstance(c, dict) and {"batch", "context", "fraction_of_bandwidth"} <= c.keys() for c in cases):
        raise InputError(f"{path} is not a `dsgraph bench` result (needs copy_bandwidth_GBps and decode cases)")
    data["_path"] = f"runtime/{MEASURED.name}" if path == MEASURED else str(path)   # no absolute paths in output
    return data


def nearest_fraction(measured: dict, batch: int, context: int) -> tuple[float, str]:
    """The achieved share of copy bandwidth in the measured decode case nearest to (batch, context):
    nearest batch first (on a log scale), then nearest context."""
    def distance(c):
        return abs(math.log(c["batch"] / batch)), abs(math.log(c["context"] / context))
    case = min(measured["decode"], key=distance)
    return float(case["fraction_of_bandwidth"]), f"batch {case['batch']} x context {case['context']}"


def check_workload(batch: int, context: int) -> None:
    if not isinstance(batch, int) or batch < 1 or not isinstance(context, int) or context < 1:
        raise InputError(f"batch and context must be whole numbers >= 1, got {batch} and {context}")


def hardware(*, batch: int, context: int, measured: dict | None = None, gpu_mem_gb: float = GPU_MEM_GB,
             bw_fraction: float | None = None, link_gbps: float = NVLINK_GBPS, net_gbps: float = NET_GBPS,
             link_latency_us: float = NVLINK_LATENCY_US, net_latency_us: float = NET_LATENCY_US) -> Hardware:
    """The Hardware of a plan: the measured figures (default: the shipped H200 run), the rest assumed."""
    check_workload(batch, context)
    for what, v in (("gpu memory", gpu_mem_gb), ("link bandwidth", link_gbps), ("network bandwidth", net_gbps)):
        if not 0 < v < math.inf:
            raise InputError(f"{what} must be a positive number, got {v}")
    if bw_fraction is not None and not 0 < bw_fraction <= 1:
        raise InputError(f"the fraction of copy bandwidth must be in (0, 1], got {bw_fraction}")
    if not 0 <= min(link_latency_us, net_latency_us) < math.inf:
        raise InputError("all-reduce latencies must be >= 0")
    measured = measured if measured is not None else load_measured()
    if bw_fraction is None:
        bw_fraction, source = nearest_fraction(measured, batch, context)
    else:
        source = "given"
    return Hardware(gpu_mem_gb * GB, measured["copy_bandwidth_GBps"] * GB, bw_fraction, source,
                    link_gbps * GB, net_gbps * GB, link_latency_us * 1e-6, net_latency_us * 1e-6,
                    measured_on=f"{measured.get('gpu', '?')}, {measured.get('date', '?')}, "
                                f"{measured.get('_path', '?')}")


# -- one call -------------------------------------------------------------------------------

@dataclass
class Deployment:
    """Every plan asked for, and the degrees the model refuses with their reasons."""
    spec_name: str
    dtype: str
    batch: int
    context: int
    hardware: Hardware
    plans: list[Plan]
    refused: dict[int, list[str]]
    weights: str = ""              # the quantised weight formats the spec stores some weights in, if any

    @property
    def precision(self) -> str:
        """"bf16", or "bf16 with fp8_e4m3_block128 weights": what the table's lines say."""
        return f"{self.dtype} with {self.weights} weights" if self.weights else self.dtype

    def to_json(self) -> dict:
        return {"spec": self.spec_name, "dtype": self.dtype, "weight_formats": self.weights,
                "batch": self.batch, "context": self.context,
                "hardware": asdict(self.hardware), "plans": [asdict(p) for p in self.plans],
                "refused": {str(n): r for n, r in self.refused.items()}}


def plan_deployment(spec, gpus=DEFAULT_GPUS, *, dtype="bf16", batch: int = 32, context: int = 4096,
                    hw: Hardware | None = None, block_size: int | None = None) -> Deployment:
    """Plans for every degree in `gpus` that ir.parallel accepts; the others in `refused`."""
    from codegen.kernel import DEFAULTS
    from ir.parallel import ParallelError, parallel_problems
    from .engine import _as_dtype
    from ir.graph import build_graph
    from .model_loader import weight_specs
    block_size = block_size or DEFAULTS.block_size
    check_workload(batch, context)
    if context > spec.dims["max_positions"]:
        raise InputError(f"context {context} exceeds {spec.name}'s max_positions {spec.dims['max_positions']}")
    torch_dtype = _as_dtype(dtype)
    hw = hw or hardware(batch=batch, context=context)
    refused = {n: p for n in gpus if (p := parallel_problems(spec, n))}
    # One phase before the passes binds what the engine's compiled graphs bind (the tests check it): 0.1 s, not 4.
    graphs = {"decode": build_graph(spec, "decode")}
    specs, gathered = weight_specs(graphs), gathered_weights(graphs)
    plans = []
    for n in gpus:
        if n in refused:
            continue
        try:
            plans.append(plan_for(spec, specs, gathered, n, dtype=torch_dtype, batch=batch, context=context, hw=hw,
                                  block_size=block_size))
        except ParallelError as e:     # a quantised weight's slice would split its scale blocks
            refused[n] = [str(e)]
    formats = sorted({s.format for s in specs.values() if s.format})
    return Deployment(spec.name, str(torch_dtype).removeprefix("torch."), batch, context, hw, plans, refused,
                      weights=", ".join(formats))


def not_fitting(d: Deployment, p: Plan) -> str:
    """The one line that says why plan `p` does not fit, with the planner's numbers."""
    gb = d.hardware.gpu_mem / GB
    need = (p.weights + p.kv_cache + p.margin) / GB
    line = (f"{d.spec_name} in {d.precision} does not fit on {p.gpus} x {gb:g} GB: per GPU weights "
            f"{p.weights / GB:.1f} GB + KV cache {p.kv_cache / GB:.1f} GB ({d.batch} x {d.context} tokens) + margin "
            f"{p.margin / GB:.1f} GB = {need:.1f} GB > {gb:g} GB")
    if p.max_batch:
        line += f"; at context {d.context} at most batch {p.max_batch} fits"
    return line
