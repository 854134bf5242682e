"""NVRTC: generated CUDA source -> CUBIN for one target architecture.

NVRTC needs no GPU, so bundles for sm_90 can be built (and CI can check that
every generated kernel compiles) on a machine without one. The NVRTC program
is named `<kernel>.cu`, so compiler messages point at the generated file that
a failure saves next to its full log.
"""
from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

from .errors import DsgraphError

# The headers generated kernels rely on; the runtime header dir must hold them all.
_REQUIRED_HEADERS = ("cuda_bf16.h", "cuda_fp16.h", "math_constants.h")
_ARCH_RE = re.compile(r"sm_(\d+)a?")
_IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_ERROR_LINES = 10


class NvrtcError(RuntimeError):
    """An NVRTC API call failed for a reason other than the source itself."""


class ArchError(DsgraphError, ValueError):
    """A target architecture the user named that NVRTC cannot build for: not 'sm_<digits>[a]',
    or one this NVRTC does not support.  Also a ValueError, which is what parse_arch raised before."""


class KernelCompileError(DsgraphError, RuntimeError):
    """NVRTC rejected a generated kernel. Names what failed and where to look."""

    def __init__(self, kernel: str, template: str, nodes: tuple[str, ...], arch: str,
                 source_path: str, log_path: str, errors: tuple[str, ...]):
        self.kernel = kernel
        self.template = template
        self.nodes = tuple(nodes)
        self.arch = arch
        self.source_path = source_path
        self.log_path = log_path
        self.errors = tuple(errors)
        shown = self.errors[:_MAX_ERROR_LINES]
        more = len(self.errors) - len(shown)
        lines = [
            f"NVRTC failed to compile kernel {kernel!r} for {arch} "
            f"(template: {template}; graph nodes: {', '.join(self.nodes) or '(none)'}):",
            *(f"  {e}" for e in shown),
        ]
        if more:
            lines.append(f"  ... and {more} more error line(s)")
        lines.append(f"source:   {source_path}")
        lines.append(f"full log: {log_path}")
        super().__init__("\n".join(lines))

    def __reduce__(self):
        # The default reduce replays args=(message,), which this __init__ does
        # not take; spell the fields out so the error survives multiprocessing.
        return (type(self), (self.kernel, self.template, self.nodes, self.arch,
                             self.source_path, self.log_path, self.errors))


@dataclass(frozen=True)
class CompileResult:
    cubin: bytes
    log: str  # warnings, if any; empty when NVRTC had nothing to say


def _nvrtc():
    # Deferred so that importing codegen never loads libnvrtc.
    from cuda.bindings import nvrtc
    return nvrtc


def _call(fn, *args):
    """Run an NVRTC binding (which returns (nvrtcResult, *values)) and raise on failure."""
    nvrtc = _nvrtc()
    err, *values = fn(*args)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, text = nvrtc.nvrtcGetErrorString(err)
        raise NvrtcError(f"{fn.__name__} failed: {text.decode(errors='replace')}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_version() -> tuple[int, int]:
    major, minor = _call(_nvrtc().nvrtcVersion)
    return (int(major), int(minor))


def parse_arch(arch: str) -> int:
    """'sm_90' / 'sm_90a' -> 90. Anything else (compute_90, 90, sm90) is an ArchError (a ValueError)."""
    m = _ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if m is None:
        raise ArchError(f"bad target architecture {arch!r}: expected 'sm_<digits>' "
                         f"with an optional 'a' suffix, e.g. 'sm_90' or 'sm_90a'")
    return int(m.group(1))


def _supported_archs() -> list[int]:
    return [int(a) for a in _call(_nvrtc().nvrtcGetSupportedArchs)]


def check_target(arch: str) -> int:
    """parse_arch, and ArchError unless this NVRTC can build for `arch`: checked before any
    compile starts (and by every compile), so `--arch sm_70` is one line, not a failed build."""
    arch_num = parse_arch(arch)
    supported = _supported_archs()
    if arch_num not in supported:
        raise ArchError(f"NVRTC {'.'.join(map(str, nvrtc_version()))} cannot target {arch}; "
                        f"it supports sm_{', sm_'.join(map(str, supported))}")
    return arch_num


def _cuda_header_dir() -> str:
    """Directory holding cuda_bf16.h & co. NVRTC does not ship them built in."""
    candidates: list[str] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
        if found:
            candidates.append(found)
    except Exception:  # pathfinder missing or unable to search: use the fallbacks below
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for d in candidates:
        if all(os.path.isfile(os.path.join(d, h)) for h in _REQUIRED_HEADERS):
            return d
    raise FileNotFoundError(
        f"CUDA runtime headers ({', '.join(_REQUIRED_HEADERS)}) not found; looked in: "
        f"{', '.join(candidates)}. Install the 'nvidia-cuda-runtime' wheel or set CUDA_HOME.")


def include_dirs() -> list[str]:
    """Only the CUDA toolkit's headers: dsgraph's own reach NVRTC as in-memory headers."""
    return [_cuda_header_dir()]


def _error_lines(log: str) -> tuple[str, ...]:
    return tuple(line.strip() for line in log.splitlines() if "error" in line.lower())


def _save_failure(log_dir: str | None, kernel_name: str, source: str,
                  log: str) -> tuple[str, str]:
    out = log_dir or tempfile.mkdtemp(prefix="dsgraph-nvrtc-")
    os.makedirs(out, exist_ok=True)
    source_path = os.path.join(out, f"{kernel_name}.cu")
    log_path = os.path.join(out, f"{kernel_name}.log")
    with open(source_path, "w", encoding="utf-8") as f:
        f.write(source)
    with open(log_path, "w", encoding="utf-8") as f:
        f.write(log)
    return source_path, log_path


def compile_cubin(source: str, kernel_name: str, *, arch: str = "sm_90",
                  options: tuple[str, ...] = (), template: str = "?",
                  nodes: tuple[str, ...] = (), log_dir: str | None = None,
                  headers: dict[str, str] | None = None) -> CompileResult:
    """Compile one generated translation unit to a CUBIN for `arch`.

    `headers` ({name: text}) are the only dsgraph headers NVRTC sees, in memory; by default
    the source's include closure from templates/include (codegen.render.include_closure),
    which is also what a bundle ships and a reviewer diffs.  `template` and `nodes` only feed
    the error message: they say which template and which graph nodes a failing kernel came from.
    """
    nvrtc = _nvrtc()
    check_target(arch)
    # The name becomes a file name (program name, saved source and log): keep it tame.
    if not _IDENT_RE.fullmatch(kernel_name):
        raise ValueError(f"kernel name {kernel_name!r} is not a C identifier")
    if isinstance(options, str):
        raise TypeError("options must be a tuple of strings, not one string")

    opts = [f"--gpu-architecture={arch}", "-std=c++17",
            *(f"--include-path={d}" for d in include_dirs()),
            "-default-device", *options]
    if headers is None:
        from .render import include_closure
        headers = include_closure(source)
    names = sorted(headers)
    prog = _call(nvrtc.nvrtcCreateProgram, source.encode("utf-8"), f"{kernel_name}.cu".encode(),
                 len(names), [headers[n].encode("utf-8") for n in names], [n.encode() for n in names])
    try:
        encoded = [o.encode() for o in opts]
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log_size = _call(nvrtc.nvrtcGetProgramLogSize, prog)
        log_buf = bytearray(log_size)
        _call(nvrtc.nvrtcGetProgramLog, prog, log_buf)
        log = bytes(log_buf).rstrip(b"\0").decode("utf-8", errors="replace")
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, status_text = nvrtc.nvrtcGetErrorString(status)
            # Options head the saved log so the failure can be reproduced by hand.
            full_log = (f"// nvrtc {'.'.join(map(str, nvrtc_version()))}: "
                        f"{status_text.decode(errors='replace')}\n"
                        f"// options: {' '.join(opts)}\n{log}")
            errors = _error_lines(log) or (status_text.decode(errors="replace"),)
            source_path, log_path = _save_failure(log_dir, kernel_name, source, full_log)
            raise KernelCompileError(kernel_name, template, tuple(nodes), arch,
                                     source_path, log_path, errors)
        cubin_size = _call(nvrtc.nvrtcGetCUBINSize, prog)
        if cubin_size == 0:
            raise NvrtcError(f"NVRTC produced no CUBIN for {kernel_name} ({arch})")
        cubin_buf = bytearray(cubin_size)
        _call(nvrtc.nvrtcGetCUBIN, prog, cubin_buf)
        return CompileResult(cubin=bytes(cubin_buf), log=log)
    finally:
        _call(nvrtc.nvrtcDestroyProgram, prog)
