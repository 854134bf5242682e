"""`dsgraph quantize --to w8a8 | w4a8 IN OUT`: write a float checkpoint in msModelSlim's layout.

    OUT/config.json                                   IN's, plus quantize: w8a8_dynamic (and, for w4a8,
                                                      moe_quantize: w4a8_dynamic)
    OUT/quant_model_description.json                  every tensor's type (FLOAT, W8A8_DYNAMIC, W4A8_DYNAMIC)
                                                      and model_quant_type, version, group_size
    OUT/quant_model_weights-0000k-of-0000n.safetensors  up to 3 shards, a module's tensors together
    OUT/quant_model_weights.safetensors.index.json    the weight map
    OUT/<every other file of IN>                      copied (tokenizer, generation config, ...)

Which linears: every decoder-layer projection but kv_b_proj is W8A8_DYNAMIC (int8_channel); with w4a8 the
routed experts are W4A8_DYNAMIC instead, in `int4_format` (default int4_channel: msModelSlim 1.0.0's
two int4 per byte along the output dim, with scale_bias; the older per-group / one-per-byte layouts on
request, for tests of the loader).  The embedding, the norms, the router gate, kv_b_proj and lm_head stay
float, as msModelSlim keeps them.  Values come from ir.formats.quantize (ir/formats_int.py defines them).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ir.formats import FORMATS, quantize
from ir.formats_int import SCALE_BIAS_DOWN_CHUNKS, scale_bias

from .errors import InputError
from .msmodelslim import DESCRIPTION_FILE, INDEX_FILE, PACKED_VERSION

TARGETS = {"w8a8": ("w8a8_dynamic", None), "w4a8": ("w8a8_dynamic", "w4a8_dynamic")}
SHARDS = 3
_LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\..*_proj[a-z_]*\.weight$")
_ROUTED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_TYPE = {"int8_channel": "W8A8_DYNAMIC"}


def msmodelslim_format(name: str, to: str, int4_format: str):
    """The format msModelSlim stores checkpoint tensor `name` in for target `to`, or None (float)."""
    if not _LINEAR.match(name) or ".kv_b_proj." in name:
        return None
    if to == "w4a8" and _ROUTED.match(name):
        return FORMATS[int4_format]
    return FORMATS["int8_channel"]


def write_msmodelslim(ckpt, config: dict, src: Path, dst: Path, to: str, int4_format: str = "int4_channel") -> dict:
    """Write Checkpoint `ckpt` (float, from folder `src` with `config`) to the new folder `dst` (see module
    docstring); returns {"quantised": n, "tensors": m, "files": [...]}."""
    from safetensors.torch import save_file

    if to not in TARGETS:
        raise InputError(f"--to must be one of fp8, {', '.join(TARGETS)}, got {to!r}")
    fmt4 = FORMATS.get(int4_format)
    if fmt4 is None or fmt4.storage != "int4":
        raise InputError(f"int4_format must be an int4 format, got {int4_format!r}")
    tensors, types, quantised = {}, {}, 0
    for name in sorted(ckpt.names()):
        fmt = msmodelslim_format(name, to, int4_format)
        if fmt is None:
            tensors[name], types[name] = ckpt.get(name).contiguous(), "FLOAT"
            continue
        w = ckpt.get(name)
        if w.shape[-2] % fmt.pack or (fmt.group and w.shape[-1] % fmt.group):
            raise InputError(f"{name} {list(w.shape)} cannot be stored as {fmt.name}: it packs {fmt.pack} output "
                             f"channels per byte" + (f" and groups {fmt.group} inputs" if fmt.group else ""))
        stored, comps = quantize(w, fmt)
        t = _TYPE.get(fmt.name, "W4A8_DYNAMIC")
        tensors[name], types[name] = stored.contiguous(), t
        for suffix, c in zip(fmt.companions, comps):
            tensors[name + suffix], types[name + suffix] = c.contiguous(), t
        if "scale_bias" in fmt.siblings:
            chunks = SCALE_BIAS_DOWN_CHUNKS if ".down_proj." in name else 1
            sb = f"{name[: -len('weight')]}scale_bias"
            tensors[sb], types[sb] = scale_bias(stored, comps, fmt, chunks), t
        quantised += 1
    order = sorted(tensors, key=lambda n: (n.rsplit(".", 1)[0], n))
    groups: list[list[str]] = []                                    # a module's tensors, kept in one shard
    for n in order:
        if groups and groups[-1][0].rsplit(".", 1)[0] == n.rsplit(".", 1)[0]:
            groups[-1].append(n)
        else:
            groups.append([n])
    shards = min(SHARDS, len(groups))
    files = [f"quant_model_weights-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for k, file in enumerate(files):
        part = [n for g in groups[k * len(groups) // shards:(k + 1) * len(groups) // shards] for n in g]
        save_file({n: tensors[n] for n in part}, str(dst / file), metadata={"format": "pt"})
        for n in part:
            weight_map[n] = file
            total += tensors[n].numel() * tensors[n].element_size()
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                              "weight_map": dict(sorted(weight_map.items()))}, indent=2) + "\n")
    dense, moe = TARGETS[to]
    grouped = to == "w4a8" and fmt4.group
    meta = {"model_quant_type": "W4A8_DYNAMIC" if moe else "W8A8_DYNAMIC",
            "version": PACKED_VERSION if not (to == "w4a8" and fmt4.pack == 1) else "0",
            "group_size": fmt4.group if grouped else 0}
    (dst / DESCRIPTION_FILE).write_text(json.dumps({**meta, **dict(sorted(types.items()))}, indent=2) + "\n")
    new_config = {**config, "quantize": dense, **({"moe_quantize": moe} if moe else {})}
    (dst / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
    for path in sorted(src.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", DESCRIPTION_FILE) \
                and not path.name.endswith(".index.json"):
            shutil.copy2(path, dst / path.name)
    return {"quantised": quantised, "tensors": len(tensors), "files": files}


__all__ = ["SHARDS", "TARGETS", "msmodelslim_format", "write_msmodelslim"]
