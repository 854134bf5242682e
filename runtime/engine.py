"""The Engine: prompts in, logits and tokens out, over a paged latent KV cache.

    engine = Engine.from_pretrained(model_dir, backend="reference", device="cpu", dtype=torch.float32)
    engine.logits([[1, 2, 3], [4, 5]])                      # one [len, vocab] tensor per prompt
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=16))[0].token_ids
    for out in engine.generate_stream([1, 2, 3], params): print(out.token_ids)   # as they come

    rid = engine.add_request([1, 2, 3], params)            # what a server drives (one thread):
    while engine.has_unfinished_requests():                #   requests join the running batch
        for out in engine.step(): ...                      #   between steps; engine.abort(rid)

Before anything is read or allocated, the constructors check the device (a GPU asked
for and none visible) and the memory the model needs (runtime/memory.py).  Generation
stops at the model's eos token (config.json / generation_config.json, as transformers'
``generate``) unless ``SamplingParams(ignore_eos=True)``.

A step packs sequences back to back (T tokens, B sequences) and hands the backend a
StepContext: positions, per-sequence lengths, block tables and slot mapping.
"""
from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from codegen.kernel import DEFAULTS
from ir.context import StepContext
from ir.parallel import check_parallel
from ir.spec import Spec, parse_spec

from .errors import CacheFullError, InputError, NonFiniteError, PromptTooLongError
from .h2d import upload_together
from .kv_cache import BlockAllocator, BlockTables, PagedLatentCache
from .memory import MemoryEstimate, check_fits, weight_bytes
from .model_loader import (compile_graphs, eos_token_ids, load_config, load_model_weights, manifest_weight_specs,
                           random_weights, resolve_spec, weight_specs)
from .parallel import check_ranks_agree, init_parallel
from .sampling import NOT_FINITE, SamplingParams, as_integer, make_generator, sample_next, token_id_tuple
from .scheduler import Scheduler, Sequence, chunk_tokens

BACKENDS = ("reference", "cuda")
DEFAULT_MAX_SEQ_LEN = 8192
DEFAULT_MAX_NUM_SEQS = 64
CPU_CACHE_BUDGET = 1 << 30        # default KV cache on the CPU (the reference backend's smoke runs)
GPU_CACHE_FRACTION = 0.5          # default KV cache on a GPU: this share of the memory free after the weights


@dataclass
class GenerationOutput:
    token_ids: list[int]                  # the new tokens (stop token included when one ended it)
    finish_reason: str                    # "stop" | "length"
    logits: torch.Tensor | None = None    # [new, vocab] float32 when SamplingParams.return_logits


@dataclass
class RequestOutput:
    """What one step() gave one request: its new tokens, and why it ended once it has."""
    request_id: int
    token_ids: list[int]                  # the tokens this step added (usually one; none when aborted)
    finish_reason: str | None = None      # None while running; then "stop" | "length" | "abort"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# dtype names the API takes besides torch dtypes (the CLI's --dtype spellings among them).
DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
               "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}
# What each backend computes in: the reference backend's torch ops run in any float dtype (float64 is
# a reference for the others); the generated kernels are written for the 2- and 4-byte ones only.
BACKEND_DTYPES = {"reference": (torch.float32, torch.bfloat16, torch.float16, torch.float64),
                  "cuda": (torch.bfloat16, torch.float16, torch.float32)}
DEVICES = "cpu, cuda or cuda:N"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _as_dtype(dtype, backend: str = "reference") -> torch.dtype:
    """`dtype` (a torch dtype or a name in DTYPE_NAMES) as a torch dtype that `backend` computes in."""
    if not isinstance(dtype, torch.dtype):
        if not isinstance(dtype, str) or dtype not in DTYPE_NAMES:
            raise InputError(f"dtype must be a torch dtype or one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
        dtype = DTYPE_NAMES[dtype]
    accepted = BACKEND_DTYPES[backend]
    if dtype not in accepted:
        elsewhere = [b for b, dtypes in BACKEND_DTYPES.items() if dtype in dtypes]
        hint = f" ({_dtype_name(dtype)} runs on backend='{elsewhere[0]}')" if elsewhere else ""
        raise InputError(f"backend='{backend}' computes in {', '.join(map(_dtype_name, accepted))}, "
                         f"got dtype={_dtype_name(dtype)}{hint}")
    return dtype


def check_device(backend: str, device) -> torch.device:
    """The device, once backend and device are known to be usable here; checked before
    any weight is read, so a wrong choice costs a second, not a full load."""
    if backend not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InputError(f"device {device!r} is not a torch device ({e}); use {DEVICES}") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device={str(dev)!r} is not one dsgraph runs on; use {DEVICES}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device={dev} needs a CUDA GPU and torch sees none (torch {torch.__version__}, "
                         f"CUDA build: {torch.version.cuda or 'none'}); use device='cpu' with backend='reference'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InputError(f"device={dev} but torch sees {torch.cuda.device_count()} GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if backend == "cuda" and dev.type != "cuda":
        raise InputError(f"backend='cuda' runs the generated kernels on a CUDA device, got device={dev}; "
                         f"use device='cuda', or backend='reference' on the CPU")
    if backend == "cuda":
        from .requirements import check_gpu
        check_gpu(dev)              # a Hopper GPU and a CUDA 13 driver
    return dev


def _count(value, what: str, default, meaning: str) -> int | None:
    """An engine argument that counts something (tokens, blocks, sequences) as an int >= 1;
    None is `default` (itself None where the engine works the value out)."""
    if value is None:
        return default
    n = as_integer(value)
    if n is None or n < 1:
        raise InputError(f"{what} must be >= 1 (a whole number {meaning}), got {value!r}")
    return n


def check_cache_args(*, block_size=None, num_blocks=None, max_seq_len=None, max_num_seqs=None) -> dict:
    """The cache and batch arguments, as ints, each checked before anything is built (none of them
    is worth a compile or a weight read when it is 0, negative, fractional or a string).  Any
    block_size >= 1 is one the cache and the kernels take (a block is just block_size rows)."""
    return {"block_size": _count(block_size, "block_size", DEFAULTS.block_size, "of tokens per cache block"),
            "num_blocks": _count(num_blocks, "num_blocks", None, "of cache blocks; None: sized to the device"),
            "max_seq_len": _count(max_seq_len, "max_seq_len", None, f"of tokens; None: the smaller of "
                                  f"{DEFAULT_MAX_SEQ_LEN} and the model's max_positions"),
            "max_num_seqs": _count(max_num_seqs, "max_num_seqs", DEFAULT_MAX_NUM_SEQS,
                                   "of sequences run together")}


def check_chunking(max_num_batched_tokens) -> int | None:
    """max_num_batched_tokens as an int >= 1 or None (no cap).  Both backends chunk: the lowered
    prefill attention reads each sequence's cached prefix (ir/passes/lower_mla_prefill.py)."""
    return _count(max_num_batched_tokens, "max_num_batched_tokens", None, "of tokens a step runs; None: no cap")


def _backend_and_device(backend: str | None, device, bundle) -> tuple[str, torch.device]:
    """The defaults (a bundle runs on cuda; cuda runs on the GPU), checked."""
    backend = backend or ("cuda" if bundle is not None else "reference")
    return backend, check_device(backend, device if device is not None else ("cuda" if backend == "cuda" else "cpu"))


# What from_pretrained / from_spec pass on besides their own parameters: the Engine's cache, batch
# and stop arguments, and the parallel and launch switches that _assemble reads.
CACHE_ARGS = ("block_size", "num_blocks", "max_seq_len", "max_num_seqs")
ENGINE_OPTIONS = (*CACHE_ARGS, "eos_token_ids", "tp", "pdl", "max_num_batched_tokens", "tuning")


def _check_call(caller: str, backend, device, dtype, bundle, options: dict) -> tuple[str, torch.device, object, dict]:
    """A constructor's (backend, device, dtype, options), checked before anything is read, compiled or
    allocated.  dtype stays None where a bundle gives it; options' cache arguments become ints (None
    stays None: the default, or a bundle's block size).  An unknown option is the TypeError Python
    gives any function, here rather than after the weights are read."""
    for name in options:
        if name not in ENGINE_OPTIONS:
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}")
    if options.get("tuning") is not None:   # the kernels' tuning, where the engine compiles the spec
        if bundle is not None:
            raise InputError("tuning applies where the engine compiles the spec; a bundle keeps the tuning it "
                             "was compiled with (dsgraph compile --tune ...)")
        from codegen.tuning import as_tuning
        options = {**options, "tuning": as_tuning(options["tuning"])}   # TuningError (one line) if bad
    backend, device = _backend_and_device(backend, device, bundle)
    if dtype is not None:
        dtype = _as_dtype(dtype, backend)
    checked = check_cache_args(**{k: options[k] for k in CACHE_ARGS if k in options})
    options = {**options, **{k: checked[k] for k in CACHE_ARGS if options.get(k) is not None}}
    if "eos_token_ids" in options:
        options["eos_token_ids"] = token_id_tuple(options["eos_token_ids"], "eos_token_ids")
    if "max_num_batched_tokens" in options:
        options["max_num_batched_tokens"] = check_chunking(options["max_num_batched_tokens"])
    return backend, device, dtype, options


def cache_plan(spec: Spec, *, block_size: int, dtype: torch.dtype, device: torch.device,
               max_seq_len: int | None, max_num_seqs: int, num_blocks: int | None) -> tuple[int, int, int]:
    """(max_seq_len, blocks per sequence, num_blocks) of the paged KV cache, from arguments its
    callers have checked (check_cache_args).

    Unless given, num_blocks is what max_num_seqs sequences of max_seq_len need, capped by a
    budget: CPU_CACHE_BUDGET on the CPU, GPU_CACHE_FRACTION of the free memory on a GPU.
    """
    dims = spec.dims
    if max_seq_len is not None and max_seq_len > dims["max_positions"]:
        raise InputError(f"max_seq_len={max_seq_len} exceeds the model's max_positions={dims['max_positions']}")
    max_seq_len = min(DEFAULT_MAX_SEQ_LEN if max_seq_len is None else max_seq_len, dims["max_positions"])
    blocks_per_seq = math.ceil(max_seq_len / block_size)
    if num_blocks is None:
        per_block = PagedLatentCache.bytes_per_block(dims["layers"], block_size, spec.model.cache_width, dtype)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * GPU_CACHE_FRACTION)
        else:
            budget = CPU_CACHE_BUDGET
        num_blocks = max(1, min(blocks_per_seq * max_num_seqs, budget // per_block))
    return max_seq_len, blocks_per_seq, num_blocks


def estimate_memory(spec: Spec, specs: dict, *, dtype: torch.dtype, device: torch.device,
                    block_size: int = DEFAULTS.block_size, num_blocks: int | None = None,
                    max_seq_len: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                    **_ignored) -> MemoryEstimate:
    """Weights plus KV cache, before either exists.  On a GPU the default cache takes a share
    of whatever is free after the weights, so only one full-length sequence's blocks count.
    `specs`: the WeightSpecs the model binds (from the graphs, or from a bundle's manifest)."""
    args = check_cache_args(block_size=block_size, num_blocks=num_blocks, max_seq_len=max_seq_len,
                            max_num_seqs=max_num_seqs)   # None: the default
    block_size = args["block_size"]
    _, blocks_per_seq, planned = cache_plan(
        spec, dtype=dtype, device=torch.device("cpu") if device.type == "cuda" else device, **args)
    if device.type == "cuda" and num_blocks is None:
        planned = blocks_per_seq
    per_block = PagedLatentCache.bytes_per_block(spec.dims["layers"], block_size, spec.model.cache_width, dtype)
    return MemoryEstimate(weight_bytes(specs, dtype), planned * per_block, dtype)


class Engine:
    def __init__(self, spec: Spec, graphs: dict, weights: dict, *, backend: str = "reference", device="cpu",
                 dtype=torch.float32, block_size: int = DEFAULTS.block_size, num_blocks: int | None = None,
                 max_seq_len: int | None = None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 eos_token_ids=(), backend_impl=None, weight_specs: dict | None = None,
                 max_num_batched_tokens: int | None = None):
        self.spec = spec
        self.graphs = graphs
        # what each bound weight reads of the checkpoint (the bundle manifest's weights table, or
        # the graphs'; None for an engine assembled by hand): runtime/hf_layout.py maps it
        self.weight_specs = weight_specs
        self.device = check_device(backend, device)
        self.dtype = _as_dtype(dtype, backend)
        args = check_cache_args(block_size=block_size, num_blocks=num_blocks, max_seq_len=max_seq_len,
                                max_num_seqs=max_num_seqs)
        block_size, max_num_seqs = args["block_size"], args["max_num_seqs"]
        self.block_size = block_size
        dims = spec.dims
        self.vocab = dims["vocab"]
        self.max_seq_len, blocks_per_seq, num_blocks = cache_plan(spec, dtype=self.dtype, device=self.device, **args)
        # The model's end-of-sequence ids: generation stops there unless SamplingParams.ignore_eos.
        self.eos_token_ids = token_id_tuple(eos_token_ids, "eos_token_ids")
        self.cache = PagedLatentCache(dims["layers"], num_blocks, block_size, spec.model.cache_width, self.dtype, self.device)
        self.tables = BlockTables(BlockAllocator(num_blocks), block_size, blocks_per_seq)
        self.blocks_per_seq = blocks_per_seq
        self.max_num_seqs = max_num_seqs
        self.backend_name = backend
        if backend_impl is None:
            from .reference_backend import ReferenceBackend  # the interpreter (and networkx) only when used
            backend_impl = ReferenceBackend(graphs, weights)
        self.backend = backend_impl
        self._seq_ids = itertools.count()
        # the requests in flight (request id -> Sequence) and the one scheduler that runs them
        self._requests: dict[int, Sequence] = {}
        self._sched = Scheduler(self.tables, self.max_num_seqs, max_prefill_tokens=max(self.max_seq_len, 8192))
        # Tokens one step runs at most (vLLM's name); None: a prompt prefills in one step.  A longer
        # prompt prefills in chunks that attend to the rows earlier chunks cached, and running
        # sequences decode in the same steps (scheduler.chunk_tokens).
        self.max_num_batched_tokens = check_chunking(max_num_batched_tokens)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir, backend: str | None = None, device=None, dtype=None, spec=None,
                        bundle=None, progress=None, cache_dir=None, weight_format=None, **kwargs) -> "Engine":
        """Load a Hugging Face DeepSeek-V2/V3 checkpoint directory (safetensors + config.json).

        backend="reference" (the default without a bundle) runs the graphs with each op's torch
        semantics; backend="cuda" runs a bundle: `bundle=DIR` (made by `dsgraph compile`), or the
        spec compiled for this GPU through the bundle cache.  ``progress``: None (quiet), True (a
        tqdm bar on stderr, hidden when stderr is not a terminal) or a callable
        ``progress(done, total)`` counting tensors read.  ``tp=N`` (launched under
        ``torchrun --nproc-per-node N``): this process is one of N ranks and reads only its
        slice of the checkpoint (runtime/parallel.py); on backend="cuda" the bundle is one
        compiled for N ranks (``compile_bundle(..., world=N)``, or the spec compiled so through
        the cache) and this process runs its rank's plan from it.  ``pdl`` (backend="cuda"):
        launch the kernels that keep the contract with programmatic dependent launch (True,
        dsgraph's default) or not (False, for an A/B); None runs a given bundle as compiled.
        ``weight_format``: None loads the weights as the spec (or the checkpoint's config) says they
        are stored; "fp8" quantises a bf16 checkpoint's linears to DeepSeek-V3's FP8 block layout as
        it loads, "dtype" dequantises an FP8 checkpoint to the model dtype (runtime/convert.py).
        ``tuning`` (backend="cuda", the spec compiled here): a codegen.tuning.Tuning, a mapping
        {section: {knob: value}} or ["section.knob=value", ...]; a bundle keeps its own.
        """
        if not isinstance(model_dir, (str, os.PathLike)):
            raise InputError(f"model_dir must be a checkpoint directory (a str or os.PathLike path), got {model_dir!r}")
        if not (progress is None or isinstance(progress, bool) or callable(progress)):
            raise InputError(f"progress must be None, True, False or a callable progress(done, total), got {progress!r}")
        backend, device, dtype, kwargs = _check_call("Engine.from_pretrained", backend, device, dtype, bundle,
                                                     kwargs)   # before anything is read
        config = load_config(model_dir)
        if spec is not None or bundle is not None:
            # A spec written from this config checks it (spec_from_config); one given alongside still
            # has to describe a model the kernels compute: no gelu, biases or foreign quantisation.
            from ir.config_to_spec import check_computable
            check_computable(config, file=os.path.join(os.fspath(model_dir), "config.json"))
        kwargs.setdefault("eos_token_ids", eos_token_ids(model_dir, config))
        if weight_format is not None:
            from .convert import spec_in_format
            if bundle is not None:
                raise InputError("a bundle carries its weight formats; weight_format applies to a spec")
            spec = spec_in_format(spec, config, weight_format)

        def read(specs, spec, dtype, device):
            return load_model_weights(model_dir, specs, spec, dtype=dtype, device=device, progress=progress,
                                      weight_format=weight_format)
        return cls._assemble(spec, config, read, f"from {model_dir}", backend=backend, device=device, dtype=dtype,
                             bundle=bundle, cache_dir=cache_dir, **kwargs)

    @classmethod
    def from_spec(cls, spec, backend: str | None = None, device=None, dtype=None, seed: int = 0, bundle=None,
                  cache_dir=None, weights: dict | None = None, **kwargs) -> "Engine":
        """A spec (or a bundle) with random weights, no checkpoint: for benchmarks and smoke runs.
        `weights` ({bound name: tensor}, e.g. taken from a transformers model in memory) replaces
        the random ones."""
        backend, device, dtype, kwargs = _check_call("Engine.from_spec", backend, device, dtype, bundle, kwargs)
        if as_integer(seed) is None or as_integer(seed) < 0:
            raise InputError(f"seed (of the random weights) must be an integer >= 0, got {seed!r}")
        seed = as_integer(seed)
        if weights is not None and not isinstance(weights, dict):
            raise InputError(f"weights must be a dict {{bound name: tensor}} or None, got {type(weights).__name__}")

        def draw(specs, spec, dtype, device):
            if weights is None:
                return random_weights(specs, dtype=dtype, device=device, seed=seed)
            missing = sorted(set(specs) - set(weights))
            if missing:
                raise InputError(f"weights lack {len(missing)} tensor(s) the model binds, e.g. {missing[0]}")
            return {name: weights[name] for name in specs}
        return cls._assemble(spec, None, draw, "with random weights" if weights is None else "with given weights",
                             backend=backend, device=device, dtype=dtype, bundle=bundle, cache_dir=cache_dir,
                             **kwargs)

    @classmethod
    def _assemble(cls, spec, config, read_weights, what: str, *, backend, device, dtype, bundle, cache_dir,
                  **kwargs):
        """The one path from (spec | bundle) to an engine.  The device is checked before anything
        is read (_check_call, by the caller) and the memory before anything is allocated;
        `read_weights(specs, spec, dtype, device)` then supplies the weights the backend binds."""
        tp = kwargs.pop("tp", None)
        pdl = kwargs.pop("pdl", None)   # the cuda backend's launches; the reference backend launches none
        tuning = kwargs.pop("tuning", None)   # the kernels' tuning where the cuda backend compiles the spec
        if backend == "reference":
            if bundle is not None:
                raise InputError("a bundle runs on backend='cuda'; the reference backend runs the spec itself")
            dtype = dtype or torch.float32
            spec = resolve_spec(spec, config)
            check_parallel(spec, 1 if tp is None else tp)     # before any process group is joined
            world, rank, device = init_parallel(tp, device)   # tp > 1: this process is one rank (runtime/parallel.py)
            check_ranks_agree("spec", spec.text)
            compiled = compile_graphs(spec, world=world, rank=rank)
            specs = weight_specs(compiled.graphs)
            check_fits(estimate_memory(spec, specs, dtype=dtype, device=device, **kwargs), device,
                       f"{spec.name} {what}" + (f" (rank {rank} of {world})" if world > 1 else ""))
            weights = read_weights(specs, spec, dtype, device)
            return cls(spec, compiled.graphs, weights, backend=backend, device=device, dtype=dtype,
                       weight_specs=specs, **kwargs)
        from .cuda_backend import CudaBackend, open_bundle  # the driver only when asked for
        if bundle is not None and spec is not None:
            raise InputError("give a spec or a bundle, not both: a bundle carries the spec it was compiled from")
        if bundle is None:
            spec = resolve_spec(spec, config)
            check_parallel(spec, 1 if tp is None else tp)     # before any process group is joined
        world, rank, device = init_parallel(tp, device)
        # tp > 1: one bundle for every rank (compiled for `world`); this process runs rank `rank`'s plan.
        loaded = open_bundle(spec, bundle_dir=bundle, device=device,
                             dtype=dtype,
                             block_size=kwargs.pop("block_size", None), cache_dir=cache_dir, world=world, rank=rank,
                             pdl=pdl, tuning=tuning)
        spec = parse_spec(loaded.spec_text, loaded.manifest["spec"]["file"])
        dtype, block_size = _as_dtype(loaded.options["dtype"], "cuda"), loaded.options["block_size"]
        specs = manifest_weight_specs(loaded.weights)    # the rank's slices
        check_fits(estimate_memory(spec, specs, dtype=dtype, device=device, block_size=block_size, **kwargs),
                   device, f"{spec.name} {what}" + (f" (rank {rank} of {world})" if world > 1 else ""))
        weights = read_weights(specs, spec, dtype, device)
        impl = CudaBackend.from_bundle(loaded, weights, dtype=dtype, top_k=spec.dims["top_k"])
        return cls(spec, None, weights, backend="cuda", device=device, dtype=dtype, block_size=block_size,
                   backend_impl=impl, weight_specs=specs, **kwargs)

    # ---- input checks -------------------------------------------------------------------------
    def _check_prompts(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (torch.Tensor, np.ndarray)):
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError("prompts must be a non-empty list of token-id lists")
        if all(as_integer(t) is not None for t in prompts):
            raise InputError("prompts must be a list of token-id lists (got a flat list; wrap it: [[...]])")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, (torch.Tensor, np.ndarray)):
                p = p.tolist()
            if not isinstance(p, (list, tuple)):
                raise InputError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
            if not p:
                raise InputError(f"prompt {i} is empty; a prompt needs at least one token")
            ids = [as_integer(t) for t in p]      # numpy and 0-d tensor integers too
            for j, (t, tid) in enumerate(zip(p, ids)):
                if tid is None:
                    raise InputError(f"prompt {i}, position {j}: token ids are integers, got {t!r}")
                if not 0 <= tid < self.vocab:
                    raise InputError(f"prompt {i}, position {j}: token id {tid} is out of range [0, {self.vocab})")
            if len(p) > self.max_seq_len:
                raise PromptTooLongError(f"prompt {i} has {len(p)} tokens; the engine holds at most "
                                         f"{self.max_seq_len} per sequence (max_seq_len; the model allows "
                                         f"{self.spec.dims['max_positions']})")
            out.append(ids)
        return out

    def _check_params(self, prompts: list[list[int]], params) -> list[SamplingParams]:
        """One SamplingParams per prompt, each of whose stop tokens the model can emit."""
        if params is None:
            params = SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InputError(f"got {len(plist)} SamplingParams for {len(prompts)} prompts")
        for i, sp in enumerate(plist):
            if not isinstance(sp, SamplingParams):
                raise InputError(f"params must be SamplingParams, got {type(sp).__name__}")
            beyond = [t for t in sp.stop_token_ids if t >= self.vocab]
            if beyond:
                raise InputError(f"prompt {i}: stop_token_ids {beyond} are outside the vocabulary [0, {self.vocab}); "
                                 f"the model never emits them")
        return plist

    def _new_tokens(self, prompt_len: int, max_new_tokens: int) -> int:
        """How many tokens a request generates at most: max_new_tokens, capped where the sequence
        reaches max_seq_len (as _advance caps it; a prompt of max_seq_len tokens still gets one)."""
        return min(max_new_tokens, max(1, self.max_seq_len - prompt_len))

    def _check_fits_cache(self, needs: list[tuple[int, str]], fix: str) -> None:
        """Refuse, before anything runs, a request that needs more cache rows than the whole cache
        holds.  `needs`: per prompt, (rows, how they add up).  Every request that passes fits the
        cache alone, which is all the scheduler needs to finish every one (Scheduler._never_fits)."""
        blocks, bs = self.tables.allocator.num_blocks, self.block_size
        for i, (rows, why) in enumerate(needs):
            if rows > blocks * bs:
                raise CacheFullError(
                    f"prompt {i} needs {rows} tokens of KV cache ({why}) but the whole cache holds {blocks * bs} "
                    f"(num_blocks={blocks} x block_size={bs}); {fix}",
                    needed=-(-rows // bs), free=self.tables.free_blocks)

    # ---- one step -----------------------------------------------------------------------------
    def _step(self, phase: str, seqs: list[Sequence], *, last_only: bool = False,
              take: list[int] | None = None) -> torch.Tensor:
        """Run the new tokens of ``seqs`` (prefill: all uncached, or the next ``take[i]`` of them; decode:
        the last one); logits [T, vocab], or with ``last_only`` [B, vocab]: each sequence's last token
        this step (the head runs on those rows alone)."""
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for i, s in enumerate(seqs):
            n = s.num_tokens
            if phase == "prefill":
                start = s.cached
                if take is not None:
                    n = start + take[i]
                ids.extend(s.tokens[start:n])
            else:   # one token: O(1) per sequence whatever its length (the host's part of a step)
                start = n - 1
                ids.append(s.last_token)
            positions.extend(range(start, n))
            slots.extend(self.tables.slot_mapping(s.seq_id, start, n))
            query_lens.append(n - start)
            context_lens.append(n)
        rows = list(itertools.accumulate(query_lens, initial=-1))[1:] if last_only else None
        ids_t, positions_t, slots_t, rows_t, tables_t = self._step_tensors(
            phase, [s.seq_id for s in seqs], ids, positions, slots, rows)
        ctx = StepContext(
            positions=positions_t,
            query_lens=query_lens, context_lens=context_lens,
            block_tables=tables_t,
            slot_mapping=slots_t,
            kv_cache=self.cache.layers, block_size=self.block_size,
            logit_rows=rows_t)
        logits = self.backend.forward(phase, ids_t, ctx)
        for s, n in zip(seqs, context_lens):
            s.cached = n
        return logits

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Every uncached token of ``seqs``, in steps of at most max_num_batched_tokens: logits [T, vocab]
        as one step gives them (each sequence's rows together, in order)."""
        if self.max_num_batched_tokens is None:
            return self._step("prefill", seqs)
        rows: dict[int, list] = {id(s): [] for s in seqs}
        while True:
            take = chunk_tokens([s.num_tokens - s.cached for s in seqs], self.max_num_batched_tokens)
            step = [(s, t) for s, t in zip(seqs, take) if t]
            if not step:
                break
            out = self._step("prefill", [s for s, _ in step], take=[t for _, t in step])
            at = 0
            for s, t in step:
                rows[id(s)].append(out[at:at + t])
                at += t
        return torch.cat([torch.cat(rows[id(s)]) for s in seqs])

    def _step_tensors(self, phase: str, seq_ids: list[int], ids: list[int], positions: list[int],
                      slots: list[int], rows: list[int] | None) -> tuple:
        """A step's host values on the device: (ids, positions, slots, logit rows or None, block tables),
        in two host-to-device copies.  A decode step of every row whose backend replays a graph
        (CudaBackend.decode_inputs) is written straight into the buffers that graph reads, so no
        device copies come before its replay."""
        # Decode tables are always max-width so a captured step graph fits every step of a batch size.
        width = self.blocks_per_seq if phase == "decode" else None
        offer = getattr(self.backend, "decode_inputs", None)   # the reference backend has none
        bufs = offer(len(seq_ids), width, self.device) if phase == "decode" and rows is None and offer else None
        if bufs is not None:
            bufs.write(ids, positions, slots, self.tables.table_rows(seq_ids, width))
            return bufs.ids, bufs.positions, bufs.slot_mapping, None, bufs.block_tables
        ids_t, positions_t, slots_t, rows_t = upload_together([ids, positions, slots, rows], self.device)
        return ids_t, positions_t, slots_t, rows_t, self.tables.table_tensor(seq_ids, self.device, width=width)

    # ---- public API ---------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(self, prompts, decode_after: int | None = None) -> list[torch.Tensor]:
        """Logits at every position of each prompt ([len, vocab] float32 each).

        By default each prompt is one prefill.  With ``decode_after=n`` the first n tokens
        are prefilled and the rest are fed one decode step at a time (teacher forcing), so
        the paged decode path is what computes positions n and later.
        """
        prompts = self._check_prompts(prompts)
        if decode_after is not None:
            decode_after = self._check_decode_after(prompts, decode_after)
        self._check_fits_cache([(len(p), "its length") for p in prompts], "raise num_blocks")
        results: list[torch.Tensor | None] = [None] * len(prompts)
        pending = list(enumerate(prompts))
        while pending:
            batch = []
            for i, p in pending:
                seq = Sequence(next(self._seq_ids), p, SamplingParams(), None, i)
                need = self.tables.blocks_needed(seq.seq_id, len(p))
                if batch and (need > self.tables.free_blocks or len(batch) >= self.max_num_seqs):
                    break
                self.tables.reserve(seq.seq_id, len(p))  # alone, a prompt fits (_check_fits_cache)
                batch.append((i, seq))
            try:
                self._logits_batch([s for _, s in batch], decode_after, results, [i for i, _ in batch])
            finally:
                for _, s in batch:
                    self.tables.release(s.seq_id)
            pending = pending[len(batch):]
        return results

    @staticmethod
    def _check_decode_after(prompts: list[list[int]], decode_after) -> int:
        """decode_after as an int that leaves some prompt tokens for the decode path: prompts no
        longer than it are prefilled whole, so one beyond every prompt would test no decode at all."""
        n = as_integer(decode_after)
        if n is None or n < 1:
            raise InputError(f"decode_after must be None or an integer >= 1, got {decode_after!r}")
        longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
        if n >= len(prompts[longest]):
            raise InputError(f"decode_after={n} leaves no token to decode: the longest prompt, prompt {longest}, has "
                             f"{len(prompts[longest])}; give decode_after < {len(prompts[longest])}")
        return n

    def _logits_batch(self, seqs: list[Sequence], decode_after, results, slots) -> None:
        if decode_after is None:
            out = self._prefill(seqs)
            start = 0
            for i, s in zip(slots, seqs):
                results[i] = out[start:start + len(s.prompt)]
                start += len(s.prompt)
            return
        # Prefill the head of every prompt, then one decode step per further position.
        full = {s.seq_id: s.prompt for s in seqs}
        rows = {s.seq_id: [] for s in seqs}
        for s in seqs:
            s.prompt = full[s.seq_id][:decode_after]
        out = self._prefill(seqs)
        start = 0
        for s in seqs:
            rows[s.seq_id].append(out[start:start + len(s.prompt)])
            start += len(s.prompt)
        while True:
            active = [s for s in seqs if len(s.prompt) < len(full[s.seq_id])]
            if not active:
                break
            for s in active:
                s.prompt = full[s.seq_id][:len(s.prompt) + 1]
            out = self._step("decode", active)
            for j, s in enumerate(active):
                rows[s.seq_id].append(out[j:j + 1])
        for i, s in zip(slots, seqs):
            results[i] = torch.cat(rows[s.seq_id])

    @torch.inference_mode()
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """Generate for every prompt (continuous batching) and return when all are done.

        Built on the request API below: each prompt is added as a request and step() runs until
        they finish, so it drives the engine itself and refuses to run beside requests that
        someone else's step() loop is serving."""
        prompts = self._check_prompts(prompts)
        plist = self._check_params(prompts, params)
        self._check_requests_fit(prompts, plist)
        self._check_no_driver("generate")
        seqs = [self._add(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, plist))]
        self._drive(seqs)
        return [self._output(s) for s in seqs]

    # ---- requests: what a server drives ---------------------------------------------------------
    # add_request queues a prompt; step() runs one engine step (admitting waiting requests into
    # the running batch: continuous batching) and says what each request got; abort() ends a
    # request, its cache blocks freed at the next step.  One thread drives these (the server's
    # engine loop, runtime/async_engine.py); generate and generate_stream drive them themselves.

    def check_request(self, prompt, params: SamplingParams | None = None) -> tuple[list[int], SamplingParams]:
        """(prompt ids, params) of one request, checked as add_request checks them, with nothing
        changed: a front end can refuse a bad request before it reaches the engine's thread."""
        [prompt] = self._check_prompts([prompt])
        [sp] = self._check_params([prompt], params)
        self._check_requests_fit([prompt], [sp])
        return prompt, sp

    def add_request(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue one prompt (a list of token ids); it joins the running batch at the next step().
        Returns the request id that step() outputs, abort() and the stream name."""
        prompt, sp = self.check_request(prompt, params)
        return self._add(prompt, sp, 0).seq_id

    def abort(self, request_id: int) -> bool:
        """End a request; its cache blocks are freed at the next step(), which reports it finished
        with finish_reason "abort".  False when no such request is in flight (done or unknown)."""
        seq = self._requests.get(request_id)
        if seq is None or seq.done:
            return False
        seq.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One engine step: admit waiting requests (one packed prefill), advance the running ones by
        a token (one batched decode); under max_num_batched_tokens, one mixed step of the running
        decodes and as much of the admitted prompts as the cap leaves.  Returns, per request that
        advanced or ended, its new tokens and its finish reason once it is done; finished requests
        then leave the engine."""
        sched = self._sched
        ended = [s for s in self._requests.values() if s.finish_reason == "abort"]
        for s in ended:
            sched.finish(s)            # frees its blocks, running or waiting
        if sched.has_work():
            admitted = sched.admit()
            if self.max_num_batched_tokens is not None:
                self._mixed_step(sched)    # prompts prefill in capped chunks beside the running decodes
            else:
                if admitted:
                    self._advance(sched, admitted, self._step("prefill", admitted, last_only=True))
                batch = [s for s in sched.decode_batch() if s not in admitted and not s.done]
                if batch:
                    self._advance(sched, batch, self._step("decode", batch))
        outs = []
        for s in list(self._requests.values()):
            new = s.output[s.reported:]
            if new or s.done:
                s.reported = len(s.output)
                outs.append(RequestOutput(s.seq_id, new, s.finish_reason))
            if s.done:
                del self._requests[s.seq_id]
        return outs

    def generate_stream(self, prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One prompt's new tokens as they come: a RequestOutput per step (token_ids: that step's
        new tokens), the last one with its finish_reason.  The request is checked now and added
        when iteration starts; closing the iterator early aborts it.  Like generate, it drives
        the steps itself."""
        prompt, sp = self.check_request(prompt, params)
        return self._stream(prompt, sp)

    def _stream(self, prompt: list[int], sp: SamplingParams) -> Iterator[RequestOutput]:
        self._check_no_driver("generate_stream")
        seq = self._add(prompt, sp, 0)
        try:
            while seq.seq_id in self._requests:
                for out in self.step():
                    if out.request_id == seq.seq_id:
                        yield out
        finally:
            self._drop([seq])          # closed early: its blocks are freed now (nobody else drives this engine)

    def _check_no_driver(self, caller: str) -> None:
        if self._requests:
            raise InputError(f"{caller}() runs the engine's steps itself, but {len(self._requests)} request(s) "
                             f"added with add_request are in flight: step() them to the end or abort them first")

    def _check_requests_fit(self, prompts: list[list[int]], plist: list[SamplingParams]) -> None:
        news = [self._new_tokens(len(p), sp.max_new_tokens) for p, sp in zip(prompts, plist)]
        # The last new token is sampled, never fed back: it takes no cache row.
        self._check_fits_cache([(len(p) + n - 1, f"{len(p)} prompt + {n} new tokens, less the last, never cached")
                                for p, n in zip(prompts, news)], "raise num_blocks or lower max_new_tokens")

    def _add(self, prompt: list[int], sp: SamplingParams, index: int) -> Sequence:
        gen = None if sp.greedy else make_generator(sp.seed, self.device)
        seq = Sequence(next(self._seq_ids), prompt, sp, gen, index)
        self._requests[seq.seq_id] = seq
        self._sched.add(seq)
        return seq

    def _drive(self, seqs: list[Sequence]) -> None:
        """step() until `seqs` are done; on an error they are aborted (their blocks freed) first."""
        try:
            while any(s.seq_id in self._requests for s in seqs):
                self.step()
        except BaseException:
            self._drop(seqs)
            raise

    def _drop(self, seqs: list[Sequence]) -> None:
        """End `seqs` at once, those still in flight as aborted, and free their blocks."""
        for s in seqs:
            if self._requests.pop(s.seq_id, None) is not None:
                s.finish_reason = s.finish_reason or "abort"
                self._sched.finish(s)

    @staticmethod
    def _output(s: Sequence) -> GenerationOutput:
        return GenerationOutput(s.output, s.finish_reason or "length",
                                torch.stack(s.logits) if s.params.return_logits and s.logits else None)

    def _mixed_step(self, sched: Scheduler) -> None:
        """One step under max_num_batched_tokens: every running sequence's next token (decode), then as
        much of the prompts still prefilling as the cap leaves (chunk_tokens); a decode step alone
        while no prompt is pending.  The sequences whose tokens are all cached after it sample.  The
        decode tokens ride in the chunk's prefill step as one-token chunks where the backend's
        `mixed_steps` allows, else they run as a decode step of their own before it (the cuda
        backend: see CudaBackend.mixed_steps)."""
        running = sched.decode_batch()
        if all(s.num_tokens - s.cached == 1 for s in running):
            if running:
                self._advance(sched, running, self._step("decode", running))
            return
        decoding = [s for s in running if s.num_tokens - s.cached == 1]
        prefilling = [s for s in running if s.num_tokens - s.cached > 1]
        take = chunk_tokens([s.num_tokens - s.cached for s in prefilling],
                            max(0, self.max_num_batched_tokens - len(decoding)))
        if decoding and not getattr(self.backend, "mixed_steps", True):
            chunks = [s for s, t in zip(prefilling, take) if t]
            decoded = self._step("decode", decoding)
            if chunks:
                logits = self._step("prefill", chunks, last_only=True, take=[t for t in take if t])
                done = [i for i, s in enumerate(chunks) if s.cached == s.num_tokens]
                if done:
                    self._advance(sched, [chunks[i] for i in done], logits[done])
            self._advance(sched, decoding, decoded)
            return
        step = decoding + [s for s, t in zip(prefilling, take) if t]
        logits = self._step("prefill", step, last_only=True, take=[1] * len(decoding) + [t for t in take if t])
        done = [i for i, s in enumerate(step) if s.cached == s.num_tokens]
        if done:
            self._advance(sched, [step[i] for i in done], logits[done])

    def _advance(self, sched: Scheduler, seqs: list[Sequence], logits: torch.Tensor) -> None:
        next_ids = sample_next(logits, [s.params for s in seqs], [s.generator for s in seqs]).tolist()
        for s, tok in zip(seqs, next_ids):
            if tok == NOT_FINITE:   # flagged in the same copy to the host: no sync of its own
                raise NonFiniteError(
                    f"prompt {s.index}, step {len(s.output) + 1} (step 1 is the prefill): the logits to sample "
                    f"from hold NaN or inf; the weights or the computation produced them (check the checkpoint "
                    f"for NaN/inf values, or try dtype=torch.float32)")
        for s, tok, row in zip(seqs, next_ids, logits):
            s.output.append(tok)
            if s.params.return_logits:
                s.logits.append(row.float().cpu())
            if tok in s.params.stop_token_ids or (not s.params.ignore_eos and tok in self.eos_token_ids):
                s.finish_reason = "stop"
            elif len(s.output) >= s.params.max_new_tokens or s.num_tokens >= self.max_seq_len:
                s.finish_reason = "length"
            if s.done:
                sched.finish(s)
