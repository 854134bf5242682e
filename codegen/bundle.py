"""Spec -> bundle on disk: both phases lowered, every unique kernel rendered and compiled.

    <bundle>/manifest.json            what runs, in order, per phase (codegen/manifest.py)
    <bundle>/spec.yaml                the spec it was compiled from (its text is part of the key)
    <bundle>/kernels/<name>.cu        generated source (what reviewers diff)
    <bundle>/kernels/include/<h>.cuh  the dsgraph headers the sources include: exactly what NVRTC saw
    <bundle>/kernels/<name>.cubin     NVRTC output for the manifest's arch (a kernel that requires an
                                      arch-specific feature, e.g. sm_90a: for that target; codegen/arch.py)
    <bundle>/ranks/rank<r>.json       world > 1 only: rank r's phases and weight slices

Bundles live in the content-addressed cache (codegen/cache.py); the key covers
exactly the spec text, every template's text, the compiler's source, the NVRTC
version, the arch and the options.  A cache hit therefore needs no graph, no
rendering and no NVRTC: only the key's inputs are read (and ir/torch are not
imported), which keeps a warm `dsgraph compile` well under a second.

manifest.json (schema 3; JSON with sorted keys, so it diffs cleanly):

    schema, key, spec {name, file, sha256, path}, compiler_hash, nvrtc_version [major, minor],
    arch, [features: the arch-specific ones its kernels need, e.g. ["sm_90a"]], options {dtype, block_size, pdl},
    phases.<prefill|decode>: see codegen/manifest.py (steps with typed arguments, buffers, nodes),
    kernels: {name: {family, role, template, params, nodes, source, cubin, includes, [requires]}},
    includes: {header: path},  weights: {name: {shape, keep_fp32, parts}},
    tasks: {decode_b<B>: path}  (world 1),
    files: {relative path: sha256}   (added by the cache when the entry is sealed)

Tensor / expert parallel (`world` > 1, ir/parallel.py): one bundle serves every rank.  The
options (and so the key) carry ``world``; instead of phases and weights the manifest lists
``ranks`` [ranks/rank0.json, ...], each {world, rank, phases, weights} with the same phase
format and each weight's slice (``part`` / ``stored``, ``experts``: codegen/manifest.py).  The
ranks' kernels are one set under kernels/ (every rank runs at the same shapes, so they are the
same kernels); what differs between ranks (expert ranges, weight slices) is what
`diff ranks/rank0.json ranks/rank1.json` shows.  A world-1 bundle is exactly what it was before
tensor parallelism (same key, same bytes).

A kernel shared by many layers (and phases) is compiled once; its file header
lists every graph node and spec op it implements.  Loading (`load_bundle`) checks the
key and the compiler hash against this dsgraph (and the world against the job's) and never
compiles anything.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ir.errors import SpecError

from . import render as render_mod
from .cache import (MANIFEST, BundleCache, cache_key, compiler_source_hash, default_cache_dir,
                    default_cache_origin)
from .errors import DsgraphError
from .kernel import DEFAULTS, DTYPES, KernelLaunch, Options, signature_key
from .paths import spec_path
from .tuning import DEFAULT_TUNING, Tuning, as_tuning

SCHEMA = 4     # 4: each phase lists its arena slots (codegen/memplan.py); each kernel step and the options
               # say whether it is launched with PDL ("pdl")
PHASES = ("prefill", "decode")  # same as ir.PHASES; spelled here so a cache hit never imports ir
SPEC_FILE = "spec.yaml"
RANKS_DIR = "ranks"
# How `dsgraph compile` is asked for a bundle of N ranks, and for one without programmatic dependent
# launch (the flags recompile_command prints).
WORLD_FLAG = "--tp"
NO_PDL_FLAG = "--no-pdl"


class BundleError(DsgraphError, RuntimeError):
    """A bundle is missing, damaged, of another schema, or built for another arch / NVRTC /
    compiler / options; the message says how to recompile it."""


@dataclass(frozen=True)
class BundleResult:
    path: Path
    cached: bool
    kernels: int
    seconds: float
    key: str = ""


@dataclass(frozen=True)
class KernelSource:
    name: str
    family: str
    role: str
    template: str
    params: dict
    nodes: tuple[str, ...]
    origins: tuple
    signature: tuple
    source: str
    includes: dict           # header name -> text: what NVRTC is given beside the source
    requires: tuple = ()     # arch-specific features (codegen/arch.py), e.g. ("sm_90a",)


@dataclass(frozen=True)
class SpecPlan:
    spec: object              # ir.Spec
    plans: dict               # phase -> PhasePlan
    graphs: dict              # phase -> post-pass graph
    world: int = 1
    rank: int = 0


# -- inputs ---------------------------------------------------------------------------

def _spec_text(spec) -> tuple[str, str]:
    """(text, file name) of a spec path or an ir.Spec."""
    if hasattr(spec, "text") and hasattr(spec, "model"):
        return spec.text, spec.file
    path = spec_path(spec)               # a file, or a shipped spec's name
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise FileNotFoundError(f"spec path is a folder, not a YAML file: {path}") from None
    except OSError as e:
        raise SpecError(f"cannot read the spec: {e.strerror or e}", file=str(path)) from None
    try:
        return data.decode("utf-8"), path.name
    except UnicodeDecodeError as e:
        raise SpecError(f"not UTF-8 text (byte {e.start}): a spec is a YAML file", file=str(path)) from None


# A page's token count is the decode attention's `int BS` template argument (templates/include/
# mla_decode.cuh): any C++ int >= 1 compiles and runs (odd sizes included; no static_assert limits
# it), one past it does not fit the int and NVRTC refuses the kernel.
MAX_BLOCK_SIZE = 2**31 - 1


def check_block_size(block_size) -> None:
    """BundleError unless `block_size` (tokens per KV-cache page) is one the kernels take."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise BundleError(f"block_size (KV-cache page size in tokens) must be a whole number from 1 to "
                          f"{MAX_BLOCK_SIZE}, got {block_size!r}")


def _check_options(arch: str, dtype: str, block_size: int, world: int = 1, pdl: bool = True,
                   jobs: int | None = None) -> None:
    from .nvrtc import ArchError, check_target
    try:
        check_target(arch)   # also one this NVRTC offers: refused here, not by the first kernel's compile
    except ArchError as e:
        raise BundleError(str(e)) from None
    if dtype not in DTYPES:
        raise BundleError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_block_size(block_size)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise BundleError(f"world (the number of ranks) must be a positive integer, got {world!r}")
    if not isinstance(pdl, bool):
        raise BundleError(f"pdl (programmatic dependent launch) must be True or False, got {pdl!r}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise BundleError(f"jobs (parallel NVRTC compiles) must be a whole number >= 1, got {jobs!r}")


def bundle_key(spec_text: str, *, arch: str, dtype: str, block_size: int, strict: bool = True,
               world: int = 1, pdl: bool = DEFAULTS.pdl, tuning: Tuning = DEFAULT_TUNING) -> str:
    from .nvrtc import nvrtc_version
    return cache_key(spec_text=spec_text, template_texts=render_mod.template_texts(),
                     compiler_hash=compiler_source_hash(), nvrtc_version=nvrtc_version(),
                     arch=arch, options=_options_json(dtype, block_size, strict, world, pdl, tuning))


def _options_json(dtype: str, block_size: int, strict: bool, world: int = 1, pdl: bool = DEFAULTS.pdl,
                  tuning: Tuning = DEFAULT_TUNING) -> dict:
    # pdl changes no kernel source (pdl.cuh's instructions are no-ops in a launch without the
    # attribute), only the manifest's launches: it is in the key because the manifest is.
    options = {"dtype": dtype, "block_size": block_size, "pdl": pdl}
    if not strict:
        options["allow_unlowered"] = True
    if world > 1:   # absent at world 1: one process's bundles keep their keys
        options["world"] = world
    changed = tuning.changed()
    if changed:     # the knobs set away from the defaults (which the compiler hash covers)
        options["tuning"] = changed
    return options


def bundle_world(manifest: dict) -> int:
    """How many ranks a bundle was compiled for (1: an ordinary bundle)."""
    return int(manifest.get("options", {}).get("world", 1))


def rank_plan_path(rank: int) -> str:
    return f"{RANKS_DIR}/rank{rank}.json"


# -- planning and rendering (no NVRTC) ---------------------------------------------------

def plan_spec(spec, opts: Options, *, strict: bool = True, world: int = 1, rank: int = 0) -> SpecPlan:
    """Spec (path, text-bearing Spec) -> both phases through the passes and lowering,
    with kernel names made unique (see disambiguate).  world > 1: rank `rank`'s part of
    them (G.graph["parallel"] asks ir/passes/shard_for_rank.py for it)."""
    import ir
    from ir.passes import run_pipeline

    from .lower import lower_graph, pipeline_knobs
    if not (hasattr(spec, "text") and hasattr(spec, "model")):
        text, file = _spec_text(spec)
        spec = ir.parse_spec(text, file)
    if world > 1:
        from ir.parallel import check_parallel
        check_parallel(spec, world)
    plans, graphs = {}, {}
    for phase in PHASES:
        G = ir.build_graph(spec, phase)
        if world > 1:
            G.graph["parallel"] = {"world": world, "rank": rank}
        G = run_pipeline(G, knobs=pipeline_knobs(opts))
        graphs[phase] = G
        plans[phase] = lower_graph(G, opts, strict=strict)
    return SpecPlan(spec, disambiguate(plans), graphs, world, rank)


def _identity(launch: KernelLaunch) -> str:
    parts = [launch.template, launch.params, signature_key(launch.args)]
    if launch.requires:
        parts.append(list(launch.requires))
    return json.dumps(parts, sort_keys=True)


def disambiguate(plans: dict) -> dict:
    """Kernel names carry the dims that usually specialise a kernel; when two different
    kernels of one bundle still share a name (say two norms of one width with different
    eps), each gets a short digest of its template, parameters and signature appended."""
    variants: dict[str, set] = {}
    for plan in plans.values():
        for launch in plan.launches:
            variants.setdefault(launch.name, set()).add(_identity(launch))
    clash = {name for name, ids in variants.items() if len(ids) > 1}
    if not clash:
        return plans
    for plan in plans.values():
        plan.steps = [dataclasses.replace(s, name=f"{s.name}__{hashlib.sha256(_identity(s).encode()).hexdigest()[:8]}")
                      if isinstance(s, KernelLaunch) and s.name in clash else s for s in plan.steps]
    return plans


def unique_kernels(plans, *, compiler_hash: str | None = None) -> list[KernelSource]:
    """One rendered source per kernel name, in first-use order; nodes and origins are the
    union over its uses.  `plans`: phase -> PhasePlan, or a list of those (every rank's).
    `compiler_hash` is stamped into the headers (bundles, not goldens)."""
    seen: dict[str, KernelLaunch] = {}
    nodes: dict[str, set] = {}
    origins: dict[str, dict] = {}
    for phase_plan in (p[phase] for p in (plans if isinstance(plans, (list, tuple)) else [plans])
                       for phase in PHASES):
        for launch in phase_plan.launches:
            first = seen.get(launch.name)
            if first is None:
                seen[launch.name] = launch
                nodes[launch.name], origins[launch.name] = set(), {}
            elif _identity(first) != _identity(launch):
                raise BundleError(
                    f"kernel name {launch.name} is used for two different kernels "
                    f"({first.template} for {', '.join(first.nodes)}; {launch.template} for "
                    f"{', '.join(launch.nodes)}): their parameters or signatures differ")
            nodes[launch.name].update(launch.nodes)
            origins[launch.name].update(dict.fromkeys(launch.origins))
    out = []
    for name, launch in seen.items():
        ns, os_ = tuple(sorted(nodes[name])), tuple(origins[name])
        source = render_mod.render_launch(launch, nodes=ns, origins=os_, compiler_hash=compiler_hash)
        out.append(KernelSource(name, launch.family, launch.role, launch.template, launch.params, ns, os_,
                                signature_key(launch.args), source, render_mod.include_closure(source),
                                tuple(launch.requires)))
    return out


def render_spec(spec, *, dtype: str = DEFAULTS.dtype, block_size: int = DEFAULTS.block_size,
                arch: str = DEFAULTS.arch, strict: bool = False, tuning=None):
    """(spec name, [KernelSource], unlowered [(phase, node, op)]): render only, no compiler hash."""
    sp = plan_spec(spec, Options(arch=arch, dtype=dtype, block_size=block_size, tuning=as_tuning(tuning)),
                   strict=strict)
    unlowered = [(ph, n, op) for ph in PHASES for n, op in sp.plans[ph].unlowered]
    return sp.spec.name, unique_kernels(sp.plans), unlowered


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


# -- compiling ----------------------------------------------------------------------------

class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.done = total, enabled, 0
        self.tty = enabled and sys.stderr.isatty()

    def step(self, name: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write(f"\r\033[Kcompiling kernels {self.done}/{self.total}: {name}")
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(f"compiled {self.done}/{self.total}: {name}\n")
        sys.stderr.flush()


def _compile_one(k: KernelSource, arch: str) -> bytes:
    from .arch import kernel_target
    from .nvrtc import compile_cubin
    # a kernel that requires an arch-specific feature (codegen/arch.py) is built for that target
    return compile_cubin(k.source, k.name, arch=kernel_target(arch, k.requires), template=k.template,
                         nodes=k.nodes, headers=k.includes).cubin


def compile_kernels(kernels: list[KernelSource], arch: str, *, jobs: int | None = None,
                    progress: bool = False) -> dict[str, bytes]:
    """Compile every kernel with NVRTC on `jobs` threads (default: one per core).

    Threads suffice: nvrtcCompileProgram releases the GIL (measured: a Python thread
    keeps spinning while another compiles), and a thread pool avoids a process pool's
    start-up and the hazards of forking a process that has imported torch."""
    jobs = max(1, jobs or os.cpu_count() or 1)
    bar = _Progress(len(kernels), progress)
    out: dict[str, bytes] = {}
    if jobs == 1 or len(kernels) <= 1:
        for k in kernels:
            out[k.name] = _compile_one(k, arch)
            bar.step(k.name)
        return out
    with ThreadPoolExecutor(max_workers=min(jobs, len(kernels))) as pool:
        futures = {pool.submit(_compile_one, k, arch): k for k in kernels}
        try:
            for fut in _as_completed(futures):
                out[futures[fut].name] = fut.result()
                bar.step(futures[fut].name)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return {k.name: out[k.name] for k in kernels}


def _as_completed(futures):
    from concurrent.futures import as_completed
    return as_completed(futures)


INCLUDE_DIR = "kernels/include"


def _builder(spec, spec_text: str, spec_file: str, key: str, opts: Options, strict: bool,
             jobs, progress: bool, stats: dict, world: int = 1):
    def build(tmp: Path) -> None:
        from .manifest import phase_to_json, weights_to_json
        from .nvrtc import nvrtc_version
        parsed = spec if hasattr(spec, "model") else _parse(spec_text, spec_file)
        ranks = [plan_spec(parsed, opts, strict=strict, world=world, rank=r) for r in range(world)]
        if world > 1:   # one name, one kernel, across every rank's phases
            disambiguate({(r, ph): p.plans[ph] for r, p in enumerate(ranks) for ph in PHASES})
        sp = ranks[0]
        compiler_hash = compiler_source_hash()
        kernels = unique_kernels([p.plans for p in ranks], compiler_hash=compiler_hash)
        cubins = compile_kernels(kernels, opts.arch, jobs=jobs, progress=progress)
        (tmp / INCLUDE_DIR).mkdir(parents=True)
        includes: dict[str, str] = {}
        for k in kernels:
            (tmp / "kernels" / f"{k.name}.cu").write_text(k.source, encoding="utf-8")
            (tmp / "kernels" / f"{k.name}.cubin").write_bytes(cubins[k.name])
            includes.update(k.includes)
        for name, text in sorted(includes.items()):
            (tmp / INCLUDE_DIR / name).write_text(text, encoding="utf-8")
        (tmp / SPEC_FILE).write_text(spec_text, encoding="utf-8")

        def plan_json(p: SpecPlan) -> dict:
            return {"phases": {ph: phase_to_json(p.plans[ph]) for ph in PHASES},
                    "weights": weights_to_json(p.graphs.values())}
        manifest = {
            "schema": SCHEMA, "key": key,
            "spec": {"name": sp.spec.name, "file": spec_file, "path": SPEC_FILE,
                     "sha256": hashlib.sha256(spec_text.encode("utf-8")).hexdigest()},
            "compiler_hash": compiler_hash, "nvrtc_version": list(nvrtc_version()),
            "arch": opts.arch,
            "options": _options_json(opts.dtype, opts.block_size, strict, world, opts.pdl, opts.tuning),
            "tuning": opts.tuning.to_json(),
            "kernels": {k.name: {"family": k.family, "role": k.role, "template": k.template, "params": k.params,
                                 "nodes": list(k.nodes), "source": f"kernels/{k.name}.cu",
                                 "cubin": f"kernels/{k.name}.cubin", "includes": sorted(k.includes),
                                 **({"requires": list(k.requires)} if k.requires else {})}
                        for k in kernels},
            "includes": {name: f"{INCLUDE_DIR}/{name}" for name in sorted(includes)},
        }
        features = sorted({f for k in kernels for f in k.requires})
        if features:   # absent where no kernel needs an arch-specific target: such bundles are unchanged
            manifest["features"] = features
        if world == 1:
            manifest.update(plan_json(sp))
        else:
            (tmp / RANKS_DIR).mkdir()
            for p in ranks:
                (tmp / rank_plan_path(p.rank)).write_text(dumps({"world": world, "rank": p.rank, **plan_json(p)}),
                                                          encoding="utf-8")
            manifest["ranks"] = [rank_plan_path(r) for r in range(world)]
        (tmp / MANIFEST).write_text(dumps(manifest), encoding="utf-8")  # last: the commit marker
        stats["kernels"] = len(kernels)
    return build


def _parse(text: str, file: str):
    import ir
    return ir.parse_spec(text, file)


def _check_out_dir(out_dir) -> None:
    """BundleError unless `out_dir` can take a bundle: a bundle there is replaced, an empty folder
    filled, a missing one made; a file, a folder of other things or a file among its parents is
    refused.  Checked before the build (and again before the copy), so a bad -o costs no compile."""
    out = Path(out_dir)
    if out.exists():
        if not out.is_dir():
            raise BundleError(f"output path {out} exists and is not a folder")
        try:
            foreign = any(out.iterdir()) and not (out / MANIFEST).is_file()
        except OSError as e:
            raise BundleError(f"cannot write the bundle to {out}: {e.strerror or e}") from None
        if foreign:
            raise BundleError(f"output folder {out} is not empty and holds no bundle "
                              f"(no {MANIFEST}); refusing to replace it")
        return
    parent = next(p for p in out.parents if p.exists())   # "." or "/" at the latest
    if not parent.is_dir():
        raise BundleError(f"cannot write the bundle to {out}: {parent} is a file, not a folder")


def _copy_out(entry: Path, out_dir) -> Path:
    """Copy a cache entry to out_dir atomically (see _check_out_dir for what it may replace).
    An OSError on the way is about the user's -o path: it names that, not our temporary names."""
    _check_out_dir(out_dir)
    try:
        return _replace_with_copy(entry, Path(out_dir).absolute())
    except OSError as e:
        raise BundleError(f"cannot write the bundle to {out_dir}: {e.strerror or e}") from None


def _replace_with_copy(entry: Path, out_dir: Path) -> Path:
    """Copy beside out_dir, then rename into place (the old bundle aside first, removed last)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{tag}")
    shutil.copytree(entry, tmp)
    aside = None
    try:
        if out_dir.exists():
            aside = out_dir.with_name(f".{out_dir.name}.old-{tag}")
            os.rename(out_dir, aside)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not out_dir.exists():
            os.rename(aside, out_dir)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return out_dir


def compile_bundle(spec, out_dir=None, *, arch: str = DEFAULTS.arch, dtype: str = DEFAULTS.dtype,
                   block_size: int = DEFAULTS.block_size, cache_dir=None, progress: bool | None = None,
                   jobs: int | None = None, strict: bool = True, world: int = 1,
                   pdl: bool = DEFAULTS.pdl, tuning=None) -> BundleResult:
    """Compile `spec` (a path or an ir.Spec) into a bundle, through the cache.

    Returns where it is (the cache entry, or `out_dir` when given), whether it was a
    cache hit, how many kernels it holds and how long this call took.  strict=False
    lets nodes no family lowers through (listed under "unlowered"; part of the key).
    world > 1: one bundle for every rank of a tensor / expert parallel job (each rank's
    graphs through the shard passes; see the module docstring); the key covers `world`.
    pdl=False: no launch is a programmatic dependent launch (for an A/B against the default).
    tuning: a codegen.tuning.Tuning (or what codegen.tuning.as_tuning takes); part of the key."""
    t0 = time.perf_counter()
    _check_options(arch, dtype, block_size, world, pdl, jobs)
    tuning = as_tuning(tuning)
    text, file = _spec_text(spec)
    if out_dir is not None:
        _check_out_dir(out_dir)
    cache = (BundleCache(cache_dir) if cache_dir is not None
             else BundleCache(default_cache_dir(), origin=default_cache_origin()))
    cache.check_root()
    key = bundle_key(text, arch=arch, dtype=dtype, block_size=block_size, strict=strict, world=world, pdl=pdl,
                     tuning=tuning)
    if progress is None:
        progress = sys.stderr.isatty()
    stats: dict = {}
    opts = Options(arch=arch, dtype=dtype, block_size=block_size, pdl=pdl, tuning=tuning)
    entry, built = cache.get_or_build(
        key, _builder(spec, text, file, key, opts, strict, jobs, progress, stats, world))
    if "kernels" in stats:
        n = stats["kernels"]
    else:
        n = len(json.loads((entry / MANIFEST).read_text(encoding="utf-8"))["kernels"])
    path = _copy_out(entry, out_dir) if out_dir is not None else entry
    return BundleResult(path=Path(path), cached=not built, kernels=n,
                        seconds=time.perf_counter() - t0, key=key)


# -- loading ------------------------------------------------------------------------------

def load_manifest(bundle_dir) -> dict:
    """Read and validate a bundle's manifest: schema, and every file against its checksum.
    Never compiles anything."""
    bundle_dir = Path(bundle_dir)
    path = bundle_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{bundle_dir} is not a bundle: no {MANIFEST}") from None
    except (OSError, ValueError) as e:
        raise BundleError(f"{path} is unreadable: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        got = manifest.get("schema") if isinstance(manifest, dict) else None
        raise BundleError(f"{path}: bundle schema {got!r}, this dsgraph reads schema {SCHEMA}; "
                          f"recompile the bundle (dsgraph compile)")
    plans_field = "phases" if "ranks" not in manifest else "ranks"
    for field in ("arch", "nvrtc_version", "options", plans_field, "kernels", "files", "spec", "compiler_hash"):
        if field not in manifest:
            raise BundleError(f"{path} lacks {field!r}")
    if not BundleCache._intact(bundle_dir):
        raise BundleError(f"bundle {bundle_dir} is damaged: a file is missing or does not match "
                          f"its checksum in {MANIFEST}; recompile it (dsgraph compile)")
    files = manifest["files"]
    for name, k in manifest["kernels"].items():
        for rel in (k.get("source"), k.get("cubin")):
            if rel not in files:
                raise BundleError(f"bundle {bundle_dir}: kernel {name} has no {rel} file")
    for rel in manifest.get("ranks", ()):
        if rel not in files:
            raise BundleError(f"bundle {bundle_dir}: its rank plan {rel} is not among its files")
    return manifest


def recompile_command(manifest: dict, bundle_dir, arch: str | None = None, dtype: str | None = None,
                      block_size: int | None = None, world: int | None = None, pdl: bool | None = None) -> str:
    """The one command that rebuilds this bundle (for this device / these options / this many ranks)."""
    opts = manifest.get("options", {})
    spec = Path(bundle_dir) / manifest.get("spec", {}).get("path", SPEC_FILE)
    world = world or bundle_world(manifest)
    pdl = opts.get("pdl", DEFAULTS.pdl) if pdl is None else pdl
    tune = "".join(f" {f}" for f in _manifest_tuning(manifest).flags())
    return (f"dsgraph compile {spec} -o {bundle_dir} --arch {arch or manifest.get('arch')} "
            f"--dtype {dtype or opts.get('dtype')} --block-size {block_size or opts.get('block_size')}"
            + (f" {WORLD_FLAG} {world}" if world > 1 else "") + ("" if pdl else f" {NO_PDL_FLAG}") + tune)


def _manifest_tuning(manifest: dict) -> Tuning:
    """The tuning a bundle was compiled with (its options' knobs away from the defaults)."""
    try:
        return Tuning.from_changed(manifest.get("options", {}).get("tuning", {}))
    except DsgraphError:
        return DEFAULT_TUNING   # a knob this dsgraph does not know: the key check refuses the bundle


def check_compatible(manifest: dict, bundle_dir, *, arch: str, nvrtc_version=None,
                     dtype: str | None = None, block_size: int | None = None, world: int | None = None,
                     pdl: bool | None = None) -> None:
    """Raise BundleError (with the command that recompiles it) unless this bundle was built by
    this compiler, from its own spec text, templates and options, for a target that runs on a
    device of arch `arch` (codegen/arch.py runs_on: sm_90 and sm_90a bundles on "sm_90"; a bundle
    whose kernels need sm_90a features is refused elsewhere with their names), this NVRTC and
    (where given) a job of `world` ranks and these options."""
    from .arch import runs_on
    fix = recompile_command(manifest, bundle_dir, arch, dtype, block_size, world, pdl)
    where = f"bundle {bundle_dir}"
    built = manifest.get("arch")
    if not (isinstance(built, str) and _arch_ok(built) and runs_on(built, arch)):
        needs = sorted(name for name, k in manifest.get("kernels", {}).items() if k.get("requires"))
        if needs:
            shown = ", ".join(needs[:3]) + (f" and {len(needs) - 3} more" if len(needs) > 3 else "")
            raise BundleError(f"{where} needs {', '.join(manifest.get('features', [built]))} (kernels {shown}), "
                              f"which this device ({arch}) does not offer; recompile it: {fix}")
        raise BundleError(f"{where} was compiled for {built}, this device is {arch}; "
                          f"recompile it: {fix}")
    if nvrtc_version is not None and tuple(manifest.get("nvrtc_version", ())) != tuple(nvrtc_version):
        built = ".".join(map(str, manifest.get("nvrtc_version", ()))) or "?"
        raise BundleError(f"{where} was compiled with NVRTC {built}, this is NVRTC "
                          f"{'.'.join(map(str, nvrtc_version))}; recompile it: {fix}")
    opts = manifest.get("options", {})
    for name, want in (("dtype", dtype), ("block_size", block_size), ("pdl", pdl)):
        if want is not None and opts.get(name) != want:
            raise BundleError(f"{where} was compiled for {name}={opts.get(name)}, the engine runs "
                              f"{name}={want}; recompile it: {fix}")
    built_for = bundle_world(manifest)
    if world is not None and built_for != world:
        run = f"run it with tp={built_for} (torchrun --nproc-per-node {built_for}) or " if built_for > 1 else ""
        raise BundleError(f"{where} was compiled for {_ranks(built_for)}, this job runs {_ranks(world)}; "
                          f"{run}recompile it: {fix}")
    if manifest.get("compiler_hash") != compiler_source_hash():
        raise BundleError(f"{where} was built by another dsgraph compiler (compiler hash "
                          f"{str(manifest.get('compiler_hash'))[:12]}, this one is {compiler_source_hash()[:12]}); "
                          f"recompile it: {fix}")
    spec_text = (Path(bundle_dir) / manifest["spec"]["path"]).read_text(encoding="utf-8")
    key = bundle_key(spec_text, arch=manifest["arch"], dtype=opts.get("dtype"), block_size=opts.get("block_size"),
                     strict=not opts.get("allow_unlowered", False), world=built_for, pdl=opts.get("pdl"),
                     tuning=_manifest_tuning(manifest))
    if key != manifest.get("key"):
        raise BundleError(f"{where} is stale: its key does not match its spec, this dsgraph's templates and "
                          f"NVRTC (something it was built from changed); recompile it: {fix}")


def _arch_ok(arch: str) -> bool:
    from .nvrtc import parse_arch
    try:
        parse_arch(arch)
    except ValueError:
        return False
    return True


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


@dataclass(frozen=True)
class LoadedBundle:
    """A bundle read back for running: its manifest, spec text and per-phase plans (of the
    rank it was loaded for, when it was compiled for world > 1)."""
    path: Path
    manifest: dict
    spec_text: str
    plans: dict              # phase -> codegen.plan.PhasePlan
    weight_table: dict | None = None    # the rank's weights table; None: the manifest's
    world: int = 1
    rank: int = 0

    @property
    def weights(self) -> dict:
        return self.weight_table if self.weight_table is not None else self.manifest.get("weights", {})

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def options(self) -> dict:
        return self.manifest["options"]


def load_rank_plan(bundle_dir, manifest: dict, rank: int) -> dict:
    """Rank `rank`'s {world, rank, phases, weights} of a bundle compiled for world > 1
    (for world 1, the manifest itself holds them)."""
    world = bundle_world(manifest)
    if world == 1:
        return manifest
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise BundleError(f"bundle {bundle_dir} holds ranks 0..{world - 1}, not rank {rank!r}")
    rel = manifest["ranks"][rank]
    plan = json.loads((Path(bundle_dir) / rel).read_text(encoding="utf-8"))
    if plan.get("world") != world or plan.get("rank") != rank:
        raise BundleError(f"bundle {bundle_dir}: {rel} is the plan of rank {plan.get('rank')} of "
                          f"{plan.get('world')}, not of rank {rank} of {world}; recompile it: "
                          f"{recompile_command(manifest, bundle_dir)}")
    return plan


def load_bundle(bundle_dir, *, arch: str, nvrtc_version=None, dtype: str | None = None,
                block_size: int | None = None, world: int = 1, rank: int = 0,
                pdl: bool | None = None) -> LoadedBundle:
    """Read a bundle to run it: verify its files, check it against this dsgraph and device
    (check_compatible) and rebuild its phases' plans from the manifest; for a process that is
    rank `rank` of `world`, the bundle must have been compiled for `world` ranks and the plans
    are that rank's.  `pdl` (where given): the bundle's launches must have been planned with
    programmatic dependent launch on (True) or off (False).  No passes, no lowering, no NVRTC, no
    networkx."""
    from .manifest import phase_from_json
    bundle_dir = Path(bundle_dir)
    manifest = load_manifest(bundle_dir)
    check_compatible(manifest, bundle_dir, arch=arch, nvrtc_version=nvrtc_version, dtype=dtype,
                     block_size=block_size, world=world, pdl=pdl)
    spec_text = (bundle_dir / manifest["spec"]["path"]).read_text(encoding="utf-8")
    plan = load_rank_plan(bundle_dir, manifest, rank)
    plans = {ph: phase_from_json(ph, d) for ph, d in plan["phases"].items()}
    return LoadedBundle(bundle_dir, manifest, spec_text, plans, weight_table=plan.get("weights", {}),
                        world=world, rank=rank)


__all__ = ["BundleError", "BundleResult", "KernelSource", "LoadedBundle", "SCHEMA", "SpecPlan", "bundle_key",
           "bundle_world", "check_compatible", "compile_bundle", "compile_kernels", "disambiguate", "load_bundle",
           "load_manifest", "load_rank_plan", "plan_spec", "recompile_command", "render_spec", "unique_kernels"]
