"""Spec -> bundle on disk: both phases lowered, every unique kernel rendered and compiled.

    <bundle>/manifest.json        what runs, in order, per phase (see below)
    <bundle>/kernels/<name>.cu    generated source (what reviewers diff)
    <bundle>/kernels/<name>.cubin NVRTC output for the manifest's arch

Bundles live in the content-addressed cache (codegen/cache.py); the key covers
exactly the spec text, every template's text, the compiler's source, the NVRTC
version, the arch and the options.  A cache hit therefore needs no graph, no
rendering and no NVRTC: only the key's inputs are read (and ir/torch are not
imported), which keeps a warm `dsgraph compile` well under a second.

manifest.json (schema 1; JSON with sorted keys, so it diffs cleanly):

    schema, key, spec {name, file, sha256}, compiler_hash, nvrtc_version [major, minor],
    arch, options {dtype, block_size},
    phases.<prefill|decode>: inputs, outputs, unlowered [[node, op]...],
        steps: [{type: "kernel", kernel, family, template, params, nodes, grid, block, smem,
                 args: [{kind, ref}], workspace: [{name, shape, dtype}]}
                | {type: "library", node, op, call, inputs, outputs, weights, attrs}],
        buffers: {value: {shape, dtype, [view: {base, offset, strides}], [layer], [parts]}},
    kernels: {name: {family, template, params, nodes, source, cubin}},
    files: {relative path: sha256}   (added by the cache when the entry is sealed)

A kernel shared by many layers (and phases) is compiled once; its file header
lists every graph node it implements.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from . import render as render_mod
from .cache import MANIFEST, BundleCache, cache_key, compiler_source_hash, default_cache_dir
from .kernel import DTYPES, KernelLaunch, Options

SCHEMA = 1
PHASES = ("prefill", "decode")  # same as ir.PHASES; spelled here so a cache hit never imports ir


class BundleError(RuntimeError):
    """A bundle is missing, damaged, of another schema, or built for another arch / NVRTC."""


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
    template: str
    params: dict
    nodes: tuple[str, ...]
    source: str


# -- inputs ---------------------------------------------------------------------------

def _spec_text(spec) -> tuple[str, str]:
    """(text, file name) of a spec path or an ir.Spec."""
    if hasattr(spec, "text") and hasattr(spec, "model"):
        return spec.text, spec.file
    path = Path(spec)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"spec file not found: {path}") from None
    except IsADirectoryError:
        raise FileNotFoundError(f"spec path is a folder, not a YAML file: {path}") from None
    return data.decode("utf-8"), path.name


def _check_options(arch: str, dtype: str, block_size: int) -> None:
    from .nvrtc import parse_arch
    try:
        parse_arch(arch)
    except ValueError as e:
        raise BundleError(str(e)) from None
    if dtype not in DTYPES:
        raise BundleError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise BundleError(f"block_size must be a positive integer, got {block_size!r}")


def bundle_key(spec_text: str, *, arch: str, dtype: str, block_size: int, strict: bool = True) -> str:
    from .nvrtc import nvrtc_version
    options = {"dtype": dtype, "block_size": block_size}
    if not strict:
        options["allow_unlowered"] = True
    return cache_key(spec_text=spec_text, template_texts=render_mod.template_texts(),
                     compiler_hash=compiler_source_hash(), nvrtc_version=nvrtc_version(),
                     arch=arch, options=options)


# -- planning and rendering (no NVRTC) ---------------------------------------------------

def plan_spec(spec, opts: Options, *, strict: bool = True):
    """Spec (path, text-bearing Spec) -> (spec, {phase: PhasePlan}, [KernelSource]) rendered."""
    import ir
    from ir.passes import run_pipeline

    from .lower import lower_graph
    if not (hasattr(spec, "text") and hasattr(spec, "model")):
        text, file = _spec_text(spec)
        spec = ir.parse_spec(text, file)
    plans = {}
    for phase in PHASES:
        G = run_pipeline(ir.build_graph(spec, phase))
        plans[phase] = lower_graph(G, opts, strict=strict)
    return spec, plans, unique_kernels(plans)


def unique_kernels(plans: dict) -> list[KernelSource]:
    """One rendered source per kernel name, in first-use order; nodes are the union over uses."""
    seen: dict[str, KernelLaunch] = {}
    nodes: dict[str, set] = {}
    for phase in PHASES:
        for launch in plans[phase].launches:
            first = seen.get(launch.name)
            if first is None:
                seen[launch.name] = launch
                nodes[launch.name] = set(launch.nodes)
                continue
            if (first.template, first.params) != (launch.template, launch.params):
                raise BundleError(
                    f"kernel name {launch.name} is used for two different kernels "
                    f"({first.template} {json.dumps(first.params, sort_keys=True)} for "
                    f"{', '.join(first.nodes)}; {launch.template} "
                    f"{json.dumps(launch.params, sort_keys=True)} for {', '.join(launch.nodes)}): "
                    f"the family must put every specialising parameter in the name")
            nodes[launch.name].update(launch.nodes)
    out = []
    for name, launch in seen.items():
        ns = tuple(sorted(nodes[name]))
        out.append(KernelSource(name, launch.family, launch.template, launch.params, ns,
                                render_mod.render(launch.template, launch.params, ns, name)))
    return out


def render_spec(spec, *, dtype: str = "bf16", block_size: int = 64, arch: str = "sm_90",
                strict: bool = False) -> tuple[str, dict[str, str], list]:
    """(spec name, {kernel name: CUDA source}, unlowered [(phase, node, op)]): render only."""
    spec, plans, kernels = plan_spec(spec, Options(arch=arch, dtype=dtype, block_size=block_size),
                                     strict=strict)
    unlowered = [(ph, n, op) for ph in PHASES for n, op in plans[ph].unlowered]
    return spec.name, {k.name: k.source for k in kernels}, unlowered


# -- manifest ----------------------------------------------------------------------------

def _step_json(step) -> dict:
    if isinstance(step, KernelLaunch):
        return {"type": "kernel", "kernel": step.name, "family": step.family,
                "template": step.template, "params": step.params, "nodes": list(step.nodes),
                "grid": list(step.grid), "block": list(step.block), "smem": step.smem,
                "args": [{"kind": a.kind, "ref": a.ref} for a in step.args],
                "workspace": [{"name": w.name, "shape": list(w.shape), "dtype": w.dtype}
                              for w in step.workspace]}
    return {"type": "library", "node": step.node, "op": step.op, "call": step.call,
            "inputs": list(step.inputs), "outputs": list(step.outputs),
            "weights": list(step.weights), "attrs": step.attrs}


def _buffer_json(buf) -> dict:
    out = {"shape": list(buf.shape), "dtype": buf.dtype}
    if buf.view is not None:
        out["view"] = {"base": buf.view.base, "offset": buf.view.offset,
                       "strides": list(buf.view.strides)}
    if buf.layer is not None:
        out["layer"] = buf.layer
    if buf.parts:
        out["parts"] = list(buf.parts)
    return out


def _phase_json(plan) -> dict:
    return {"inputs": list(plan.inputs), "outputs": list(plan.outputs),
            "steps": [_step_json(s) for s in plan.steps],
            "buffers": {name: _buffer_json(b) for name, b in plan.buffers.items()},
            "unlowered": [list(u) for u in plan.unlowered]}


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
    from .nvrtc import compile_cubin
    return compile_cubin(k.source, k.name, arch=arch, template=k.template, nodes=k.nodes).cubin


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


def _builder(spec, spec_text: str, spec_file: str, key: str, opts: Options, strict: bool,
             jobs, progress: bool, stats: dict):
    def build(tmp: Path) -> None:
        from .nvrtc import nvrtc_version
        parsed, plans, kernels = plan_spec(spec if hasattr(spec, "model") else _parse(spec_text, spec_file),
                                           opts, strict=strict)
        cubins = compile_kernels(kernels, opts.arch, jobs=jobs, progress=progress)
        kdir = tmp / "kernels"
        kdir.mkdir()
        for k in kernels:
            (kdir / f"{k.name}.cu").write_text(k.source, encoding="utf-8")
            (kdir / f"{k.name}.cubin").write_bytes(cubins[k.name])
        options = {"dtype": opts.dtype, "block_size": opts.block_size}
        if not strict:
            options["allow_unlowered"] = True
        manifest = {
            "schema": SCHEMA, "key": key,
            "spec": {"name": parsed.name, "file": spec_file,
                     "sha256": hashlib.sha256(spec_text.encode("utf-8")).hexdigest()},
            "compiler_hash": compiler_source_hash(), "nvrtc_version": list(nvrtc_version()),
            "arch": opts.arch, "options": options,
            "phases": {ph: _phase_json(plans[ph]) for ph in PHASES},
            "kernels": {k.name: {"family": k.family, "template": k.template, "params": k.params,
                                 "nodes": list(k.nodes), "source": f"kernels/{k.name}.cu",
                                 "cubin": f"kernels/{k.name}.cubin"} for k in kernels},
        }
        (tmp / MANIFEST).write_text(dumps(manifest), encoding="utf-8")  # last: the commit marker
        stats["kernels"] = len(kernels)
    return build


def _parse(text: str, file: str):
    import ir
    return ir.parse_spec(text, file)


def _copy_out(entry: Path, out_dir: Path) -> Path:
    """Copy a cache entry to out_dir atomically: copy beside it, then rename into place.
    An existing bundle there is replaced; any other non-empty folder is refused."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists():
        if not out_dir.is_dir():
            raise BundleError(f"output path {out_dir} exists and is not a folder")
        if any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
            raise BundleError(f"output folder {out_dir} is not empty and holds no bundle "
                              f"(no {MANIFEST}); refusing to replace it")
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


def compile_bundle(spec, out_dir=None, *, arch: str = "sm_90", dtype: str = "bf16",
                   block_size: int = 64, cache_dir=None, progress: bool | None = None,
                   jobs: int | None = None, strict: bool = True) -> BundleResult:
    """Compile `spec` (a path or an ir.Spec) into a bundle, through the cache.

    Returns where it is (the cache entry, or `out_dir` when given), whether it was a
    cache hit, how many kernels it holds and how long this call took.  strict=False
    lets nodes no family lowers through (listed under "unlowered"; part of the key)."""
    t0 = time.perf_counter()
    _check_options(arch, dtype, block_size)
    text, file = _spec_text(spec)
    key = bundle_key(text, arch=arch, dtype=dtype, block_size=block_size, strict=strict)
    cache = BundleCache(cache_dir if cache_dir is not None else default_cache_dir())
    if progress is None:
        progress = sys.stderr.isatty()
    stats: dict = {}
    opts = Options(arch=arch, dtype=dtype, block_size=block_size)
    entry, built = cache.get_or_build(
        key, _builder(spec, text, file, key, opts, strict, jobs, progress, stats))
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
    for field in ("arch", "nvrtc_version", "options", "phases", "kernels", "files"):
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
    return manifest


def check_compatible(manifest: dict, arch: str, nvrtc_version=None) -> None:
    """Raise BundleError unless the bundle was built for `arch` (and this NVRTC, if given)."""
    if manifest.get("arch") != arch:
        raise BundleError(f"bundle was compiled for {manifest.get('arch')}, this device is {arch}; "
                          f"recompile it: dsgraph compile --arch {arch}")
    if nvrtc_version is not None and tuple(manifest.get("nvrtc_version", ())) != tuple(nvrtc_version):
        built = ".".join(map(str, manifest.get("nvrtc_version", ()))) or "?"
        raise BundleError(f"bundle was compiled with NVRTC {built}, this is NVRTC "
                          f"{'.'.join(map(str, nvrtc_version))}; recompile it (dsgraph compile)")


__all__ = ["BundleError", "BundleResult", "KernelSource", "SCHEMA", "bundle_key", "check_compatible",
           "compile_bundle", "compile_kernels", "load_manifest", "plan_spec", "render_spec",
           "unique_kernels", "asdict"]
