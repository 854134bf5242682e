"""`dsgraph quantize --to fp8 IN OUT`: write a bf16 / fp32 checkpoint as DeepSeek-V3 writes its FP8 one.
(`--to w8a8 | w4a8`: as Huawei's msModelSlim writes its integer ones, runtime/msmodelslim_write.py.)

    OUT/config.json                         IN's, plus V3's quantization_config (V3_QUANTIZATION_CONFIG)
    OUT/<each of IN's safetensors files>    the same tensors in the same files, the linears V3 stores in FP8
                                            (ir.formats.FP8_CHECKPOINT_GLOBS) as float8_e4m3fn, each with its
                                            float32 `<name>_scale_inv` [ceil(O/128), ceil(I/128)] in its file
    OUT/model.safetensors.index.json        when IN has one: the weight map with the scales added
    OUT/<every other file of IN>            copied (tokenizer, generation config, ...)

The values come from runtime/convert.py's view, which quantises with ir.formats.quantize: the same
rule `Engine.from_pretrained(dir, weight_format="fp8")` applies at load.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from .errors import InputError

# What DeepSeek-V3's config.json says of its FP8 weights (transformers' FineGrainedFP8Config keys).
V3_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                          "weight_block_size": [128, 128]}


TARGETS = ("fp8", "w8a8", "w4a8")


def quantize_checkpoint(src, dst, to: str = "fp8", **options) -> dict:
    """Write checkpoint `src` quantised to `to` (TARGETS) at `dst` (a new or empty folder); returns
    {"quantised": n, "tensors": m, "files": [...]}.  `options`: w4a8's int4_format."""
    from safetensors.torch import save_file

    from .convert import Converted
    from .weights import CONFIG_FILE, INDEX_FILE, Checkpoint, load_config
    if to not in TARGETS:
        raise InputError(f"--to must be fp8 (DeepSeek-V3's e4m3 block-128 layout), w8a8 or w4a8 (msModelSlim's "
                         f"int8 / int4 layouts), got {to!r}")
    src, dst = Path(src), Path(dst)
    config = load_config(src)
    for key in ("quantization_config", "quantize", "moe_quantize"):
        if config.get(key) is not None:
            raise InputError(f"{src / CONFIG_FILE} has a {key} already: the checkpoint is quantised")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise InputError(f"{dst} exists and is not an empty folder; give a new one")
    if dst.resolve() == src.resolve():
        raise InputError("OUT must be another folder than IN")
    if to != "fp8":
        from .msmodelslim_write import write_msmodelslim
        return write_msmodelslim(Checkpoint.open(src), config, src, dst, to, **options)
    if options:
        raise InputError(f"--to fp8 takes no options, got {', '.join(options)}")
    view = Converted(Checkpoint.open(src), to)
    by_file: dict[str, list[str]] = {}
    for name in sorted(view.names()):
        base = name[: -len("_scale_inv")] if name not in view.inner else name
        by_file.setdefault(view.inner.shard_file(base), []).append(name)
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for file, names in sorted(by_file.items()):
        tensors = {n: view.get(n).contiguous() for n in names}
        save_file(tensors, str(dst / file), metadata={"format": "pt"})
        for n, t in tensors.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
        del tensors
    if (src / INDEX_FILE).is_file():
        index = json.loads((src / INDEX_FILE).read_text())
        index["metadata"] = {**index.get("metadata", {}), "total_size": total}
        index["weight_map"] = dict(sorted(weight_map.items()))
        (dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (dst / CONFIG_FILE).write_text(json.dumps({**config, "quantization_config": V3_QUANTIZATION_CONFIG}, indent=2) + "\n")
    for path in sorted(src.iterdir()):
        if path.is_file() and path.name not in (CONFIG_FILE, INDEX_FILE) and path.name not in by_file \
                and path.suffix != ".safetensors":
            shutil.copy2(path, dst / path.name)
    return {"quantised": len(view.quantised), "tensors": len(weight_map), "files": sorted(by_file)}


def add_quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", required=True, choices=TARGETS,
                   help="the format: fp8 = DeepSeek-V3's float8_e4m3fn weights with a float32 scale per 128x128 block; "
                        "w8a8 = msModelSlim's int8 per-channel linears (W8A8_DYNAMIC); w4a8 = the same with the "
                        "routed experts in packed int4 (W4A8_DYNAMIC 1.0.0)")
    p.add_argument("input", metavar="IN", help="a Hugging Face DeepSeek-V2/V3 checkpoint folder (bf16 or fp32)")
    p.add_argument("output", metavar="OUT", help="a new folder for the quantised checkpoint")


def run_quantize(args) -> int:
    """write a checkpoint's linears in DeepSeek-V3's FP8 layout or msModelSlim's W8A8 / W4A8 one"""
    done = quantize_checkpoint(args.input, args.output, args.to)
    print(f"quantised {done['quantised']} linear weights to {args.to} ({done['tensors']} tensors in "
          f"{len(done['files'])} file(s)) -> {args.output}")
    return 0


__all__ = ["TARGETS", "V3_QUANTIZATION_CONFIG", "add_quantize_args", "quantize_checkpoint", "run_quantize"]
