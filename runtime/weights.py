"""Lazy reading of safetensors checkpoints in the Hugging Face layout.

A checkpoint is one `model.safetensors`, a sharded set described by
`model.safetensors.index.json`, or loose `*.safetensors` files. The model
states what it needs as WeightSpecs; `load_weights` checks the whole
checkpoint against them from metadata alone before reading any tensor data,
so a wrong checkpoint fails in milliseconds with every problem named rather
than after minutes of loading.

A stacked weight's part is a whole checkpoint tensor or a slice of one (ir.ops.WeightSlice: the
shared experts stacked ahead of the routed ones); either way the checkpoint is read as stored.
A quantised weight (WeightSpec.format: DeepSeek-V3's FP8) is loaded as stored, its scales as
weights of their own; a checkpoint whose storage differs from the spec's is a WeightError naming
the tensor (runtime/convert.py converts a checkpoint on request instead).

Dimension legend: E experts, I expert intermediate size, D hidden size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ir.formats import FORMATS, FP8, companion_names, stored_shape
from ir.ops.base import WeightSlice
from runtime.errors import WeightError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

# How a quantised format's elements are stored: safetensors dtype and torch dtype (ir/formats.py storage).
STORED = {"fp8_e4m3": ("F8_E4M3", torch.float8_e4m3fn), "int8": ("I8", torch.int8), "int4": ("I8", torch.int8)}
FP8_DTYPE = STORED[FP8.storage][0]

_FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_MAX_LISTED = 10  # per kind of problem; the rest is summarised as a count


class Checkpoint:
    """Memory-mapped, read-only view of a checkpoint's tensors by name.

    Each shard is opened once and its handle kept, so metadata queries and
    reads cost no re-parsing of headers.
    """

    def __init__(self, model_dir: Path, handles: dict[str, object], shard_of: dict[str, str]):
        self.model_dir = model_dir
        self._handles = handles  # shard file name -> safe_open handle
        self._shard_of = shard_of  # tensor name -> shard file name
        self.reads: list[tuple[str, tuple[int, int, int] | None]] = []

    @classmethod
    def open(cls, model_dir: str | Path) -> Checkpoint:
        root = Path(model_dir)
        if not root.is_dir():
            raise WeightError(f"model directory {root} does not exist or is not a directory")
        # Same precedence as transformers: a single file wins over an index.
        if (root / SINGLE_FILE).is_file():
            return cls._from_files(root, [SINGLE_FILE])
        if (root / INDEX_FILE).is_file():
            return cls._from_index(root)
        files = sorted(p.name for p in root.glob("*.safetensors") if p.is_file())
        if not files:
            raise WeightError(
                f"{root} holds no safetensors checkpoint "
                f"(looked for {SINGLE_FILE}, {INDEX_FILE} or *.safetensors)"
            )
        return cls._from_files(root, files)

    @classmethod
    def _from_files(cls, root: Path, files: list[str]) -> Checkpoint:
        handles = {f: _open_shard(root / f) for f in files}
        shard_of: dict[str, str] = {}
        for f, handle in handles.items():
            for name in handle.keys():
                if name in shard_of:
                    raise WeightError(
                        f"tensor {name} is stored twice, in {root / shard_of[name]} and {root / f}; "
                        f"add a {INDEX_FILE} or remove one of the files"
                    )
                shard_of[name] = f
        return cls(root, handles, shard_of)

    @classmethod
    def _from_index(cls, root: Path, index: str = INDEX_FILE) -> Checkpoint:
        index_path = root / index
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightError(f"cannot read the weight_map of {index_path}: {e}") from None
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (root / s).is_file()]
        if absent:
            raise WeightError(f"{index_path} names shard(s) that do not exist in {root}: {', '.join(absent)}")
        handles = {s: _open_shard(root / s) for s in shards}
        keys = {s: set(h.keys()) for s, h in handles.items()}
        lost = sorted(n for n, s in weight_map.items() if n not in keys[s])
        if lost:
            raise WeightError(
                f"{index_path} maps {len(lost)} tensor(s) to shards that do not contain them: "
                + ", ".join(f"{n} -> {weight_map[n]}" for n in lost[:_MAX_LISTED])
            )
        return cls(root, handles, dict(weight_map))

    def names(self) -> set[str]:
        return set(self._shard_of)

    def shard_file(self, name: str) -> str:
        """The file (relative to model_dir) that holds tensor `name`."""
        self._handle(name)   # a WeightError naming it if absent
        return self._shard_of[name]

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype_str(self, name: str) -> str:
        return self._handle(name).get_slice(name).get_dtype()

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor as stored (dtype untouched), on the CPU; ``part`` = (dim, start, stop)
        reads only that slice (safetensors get_slice: the rest is never read).  Every read is
        logged in ``self.reads`` as (name, part), so a test can see what a rank touched."""
        self.reads.append((name, part))
        if part is None:
            return self._handle(name).get_tensor(name)
        dim, start, stop = part
        sl = self._handle(name).get_slice(name)
        return sl[start:stop] if dim == 0 else sl[:, start:stop]

    def _handle(self, name: str):
        shard = self._shard_of.get(name)
        if shard is None:
            raise WeightError(f"tensor {name} is not in the checkpoint at {self.model_dir}")
        return self._handles[shard]


def _open_shard(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise WeightError(f"cannot open safetensors file {path}: {e}") from None


def read_json_object(path: Path, what: str) -> dict:
    """A checkpoint's JSON file that must hold an object; a WeightError naming `what` otherwise."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise WeightError(f"cannot read {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise WeightError(f"{what} {path} is not a JSON object")
    return data


def load_config(model_dir: str | Path) -> dict:
    from codegen.paths import missing_model_folder
    why = missing_model_folder(model_dir)
    if why is not None:
        raise WeightError(why)
    return read_json_object(Path(model_dir) / CONFIG_FILE, "model config")


Part = str | WeightSlice


def part_name(part: Part) -> str:
    """The checkpoint tensor a stacked weight's part reads."""
    return part if isinstance(part, str) else part.name


@dataclass(frozen=True)
class WeightSpec:
    """What the model needs under one bound name.

    `parts`: checkpoint tensors (a name) or slices of them (a WeightSlice) stacked along a
    new dim 0 (per-expert weights become one [E, ...] tensor); `shape` is then the stacked
    shape, and each part's shape must be shape[1:].
    `keep_fp32`: load as float32 whatever the model dtype (routing is
    sensitive to rounding: router weights, e_score_correction_bias).
    """

    shape: tuple[int, ...]
    keep_fp32: bool = False
    parts: tuple[Part, ...] | None = None
    # Tensor / expert parallel (ir/parallel.py): `part` = (dim, start, stop) of the stored
    # tensor this rank holds (its shape is then `stored`); `others` = the per-expert tensors
    # other ranks hold, known to the checkpoint check but never read here.
    part: tuple[int, int, int] | None = None
    stored: tuple[int, ...] | None = None
    others: tuple[str, ...] = ()
    # a quantised storage format's name (ir/formats.py): loaded as stored, never widened; its
    # companions (scales) are WeightSpecs of their own.  None: cast to the model dtype.
    format: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.stored is not None:
            object.__setattr__(self, "stored", tuple(int(d) for d in self.stored))
        object.__setattr__(self, "others", tuple(self.others))
        if self.parts is not None:
            object.__setattr__(self, "parts", tuple(self.parts))
            if not self.shape or self.shape[0] != len(self.parts):
                raise ValueError(
                    f"a stacked WeightSpec of {len(self.parts)} parts needs shape[0] == {len(self.parts)}, "
                    f"got shape {self.shape}"
                )
            for p in self.parts:
                if isinstance(p, WeightSlice):
                    _check_slice(p, self.shape[1:])

    def sources(self, key: str) -> list[tuple[str, tuple[int, ...]]]:
        """(checkpoint name, expected shape of that tensor) for each tensor read, each once:
        a tensor that several slices of the stack come from is one source (checked once,
        reported missing once), of its whole stored shape."""
        if self.parts is None:
            return [(key, self.stored or self.shape)]
        out: dict[str, tuple[int, ...]] = {}
        for p in self.parts:
            out.setdefault(part_name(p), self.shape[1:] if isinstance(p, str) else p.stored)
        return list(out.items())

    def read_count(self) -> int:
        """How many reads loading this weight takes (one a part: what progress counts)."""
        return 1 if self.parts is None else len(self.parts)


def _check_slice(p: WeightSlice, want: tuple[int, ...]) -> None:
    """A sliced part that cannot fill its stack slot is a manifest that does not fit: say so in a line."""
    problem = p.problem()
    if problem is None and p.shape() != want:
        problem = f"slice {p.part} of {p.stored} has shape {p.shape()}, the stack's slots are {want}"
    if problem is not None:
        raise WeightError(f"stacked part {p.name}: {problem}")


def _ignore_nothing(name: str) -> bool:
    return False


def load_weights(
    ckpt: Checkpoint,
    specs: dict[str, WeightSpec],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    ignore: Callable[[str], bool] = _ignore_nothing,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """One tensor per key of `specs`, cast to `dtype` (float32 for keep_fp32
    specs) and placed on `device`.

    Tensors are read one at a time and written straight into their result, so
    peak host memory stays near one tensor rather than a second copy of the
    model. `progress(done, total)` counts reads, one a checkpoint tensor or
    stacked part (a slice of a tensor is a read of its own; FP8 scales not
    included); it is first called with done=0.
    """
    check_checkpoint(ckpt, specs, ignore)
    total = sum(spec.read_count() for spec in specs.values())
    done = 0
    if progress is not None:
        progress(done, total)
    out: dict[str, torch.Tensor] = {}
    for key, spec in specs.items():
        target = stored_dtype(spec) or (torch.float32 if spec.keep_fp32 else dtype)
        if spec.parts is None:
            out[key] = _read(ckpt, key, device, spec.part).to(device=device, dtype=target)
            done += 1
            if progress is not None:
                progress(done, total)
            continue
        # Allocate the stack once at its final dtype and place; each expert is
        # copied in and dropped, never held alongside the others.
        stacked = torch.empty(stored_shape_of(spec, spec.shape), dtype=target, device=device)
        for e, p in enumerate(spec.parts):
            stacked[e].copy_(_read_part(ckpt, p, device))
            done += 1
            if progress is not None:
                progress(done, total)
        out[key] = stacked
    return out


def check_checkpoint(ckpt: Checkpoint, specs: dict[str, WeightSpec], ignore: Callable[[str], bool]) -> None:
    """Raise one WeightError naming every missing, unexpected, mis-shaped or
    unusable tensor; reads metadata only."""
    available = ckpt.names()
    used: set[str] = set()
    missing: list[str] = []
    wrong: list[str] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()   # each tensor checked once, however many slices read it
    for key, spec in specs.items():
        used.update(n for n in spec.others if n in available)   # other ranks' experts
        for name, shape in spec.sources(key):
            if (name, shape) in seen:
                continue
            seen.add((name, shape))
            if name not in available:
                missing.append(f"{name} (expected shape {shape})")
                continue
            used.add(name)
            problem = _check_tensor(ckpt, name, stored_shape_of(spec, shape), spec.format, used)
            if problem:
                wrong.append(problem)
    unexpected = sorted(n for n in available - used if not _is_ignored(n, ignore))
    sections = []
    if missing:
        sections.append(_section(f"{len(missing)} tensor(s) missing from the checkpoint", missing))
    if unexpected:
        sections.append(_section(f"{len(unexpected)} unexpected tensor(s), neither used nor ignored", unexpected))
    if wrong:
        sections.append(_section(f"{len(wrong)} tensor(s) with the wrong shape or dtype", wrong))
    if sections:
        raise WeightError(f"checkpoint at {ckpt.model_dir} does not match the model:\n" + "\n".join(sections))


def stored_shape_of(spec: WeightSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored shape of a tensor `spec` reads as `shape` (packed int4 holds two output channels a byte)."""
    return stored_shape(FORMATS[spec.format] if spec.format else None, shape)


def stored_dtype(spec: WeightSpec) -> torch.dtype | None:
    """The torch dtype a quantised weight is held in as stored, or None (cast to the model dtype)."""
    return None if spec.format is None else STORED[FORMATS[spec.format].storage][1]


def _check_tensor(ckpt: Checkpoint, name: str, shape: tuple[int, ...], fmt: str | None, used: set[str]) -> str | None:
    got = ckpt.shape(name)
    if got != shape:
        return f"{name}: checkpoint has shape {got}, the spec expects {shape}"
    dt = ckpt.dtype_str(name)
    if fmt is not None:
        want = STORED[FORMATS[fmt].storage][0]
        if dt != want:
            return (f"{name}: the spec stores it as {fmt} ({want}), the checkpoint has {dt}; quantise the "
                    f"checkpoint (dsgraph quantize --to fp8) or load it with weight_format='fp8'")
        return None
    if dt in _FLOAT_DTYPES:
        return None
    if dt == FP8_DTYPE:
        used.update(n for n in companion_names(name, FP8) if n in ckpt)   # reported once, with its weight
        return (f"{name}: the checkpoint stores it as {FP8_DTYPE} ({FP8.name}), the spec expects the activation "
                f"dtype; take the spec from the checkpoint's config.json (its weight_formats) or load it with "
                f"weight_format='dtype' to dequantise")
    return f"{name}: checkpoint dtype {dt} is not one dsgraph can load ({', '.join(sorted(_FLOAT_DTYPES))}, {FP8_DTYPE})"


def _is_ignored(name: str, ignore: Callable[[str], bool]) -> bool:
    # A scale follows its weight: ignoring X.weight also ignores X.weight_scale_inv.
    for suffix in FP8.companions:
        if name.endswith(suffix) and ignore(name[: -len(suffix)]):
            return True
    return ignore(name)


def _section(title: str, items: list[str]) -> str:
    lines = [f"{title}:"] + [f"  {item}" for item in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        lines.append(f"  ... and {len(items) - _MAX_LISTED} more")
    return "\n".join(lines)


def _read(ckpt: Checkpoint, name: str, device: torch.device | str,
          part: tuple[int, int, int] | None = None) -> torch.Tensor:
    """One checkpoint tensor (or its slice `part` = (dim, start, stop)) as stored; the caller casts
    (unless it is quantised) and places it."""
    return ckpt.get(name, part)


def _read_part(ckpt: Checkpoint, p: Part, device: torch.device | str) -> torch.Tensor:
    """One stacked part: the whole tensor it names, or just its slice (safetensors reads no more)."""
    if isinstance(p, str):
        return _read(ckpt, p, device)
    return _read(ckpt, p.name, device, p.part)

