"""Load and validate a model spec (model_specs/*.yaml).

Everything a user can get wrong is caught here or in the graph builder and reported
as one SpecError naming file, YAML path and line: unknown op, unknown attribute,
undefined value, missing dim, wrong type.  Shapes and dtypes are checked when the
graph is built (``load_spec`` builds it once so a broken spec fails at load time).

Besides the model (dims, config, layer_plan, blocks) a spec may say how its checkpoint stores the
weights: ``weight_formats:``, a map from a glob over bound weight names to a storage format, first
match wins (see _parse_weight_formats; `dsgraph spec --from-config` writes it from DeepSeek-V3's
quantization_config).  Unmatched weights are stored in the activation dtype.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

from .errors import SpecError, closest, did_you_mean
from .formats import ACT, FORMATS
from .model import NULLABLE_DIMS, REQUIRED_DIMS, ModelConfig, RopeConfig
from .ops import OPS
from .ops.base import FLOAT32_MAX, AttrError, width_problem
from .rope import attention_factor
from .yaml_source import Located, load_located

SCHEMA = 1
TOP_KEYS = {"schema", "name", "model_type", "dims", "config", "layer_plan", "blocks", "weight_formats"}
MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
REQUIRED_BLOCKS = ("embed", "decoder_layer", "head")
PLACEHOLDER = re.compile(r"\{([^{}]*)\}")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FLOAT32_MIN = 1.1754943508222875e-38   # the smallest normal float32
MAX_LAYERS = 1024
MAX_EXPERT_LAYERS = 1 << 20             # layers x experts
MAX_ROPE_DIM = 4096


@dataclass(frozen=True)
class OpDecl:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict
    weights: dict          # role -> checkpoint name template ({layer}, {expert})
    path: str


@dataclass(frozen=True)
class Block:
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ops: tuple[OpDecl, ...]
    path: str


@dataclass(frozen=True)
class LayerKind:
    attention: str
    ffn: str


@dataclass(frozen=True)
class LayerPlan:
    first_k_dense_replace: int
    moe_layer_freq: int
    dense_layer: LayerKind
    moe_layer: LayerKind

    def kind(self, layer: int) -> tuple[str, LayerKind]:
        if layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0:
            return "moe", self.moe_layer
        return "dense", self.dense_layer


@dataclass
class Spec:
    file: str
    text: str
    model: ModelConfig
    plan: LayerPlan
    blocks: dict[str, Block]
    located: Located = field(repr=False)
    # (glob over bound checkpoint names, format name or ACT), in the spec's order: the first match wins
    weight_formats: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        return self.model.name

    @property
    def dims(self) -> dict:
        return self.model.dims

    def error(self, path: str, message: str) -> SpecError:
        return self.located.error(path, message)


def _get(loc: Located, data: dict, key: str, path: str, kind, *, required=True, default=None):
    full = f"{path}.{key}" if path else key
    if key not in data:
        if required:
            raise loc.error(path, f"missing required key {key!r}")
        return default
    value = data[key]
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise loc.error(full, f"expected a number, got {value!r}")
        try:
            value = float(value)
        except ValueError:
            raise loc.error(full, f"expected a number, got {value!r}") from None
        if not math.isfinite(value):
            raise loc.error(full, f"expected a finite number, got {value!r}")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise loc.error(full, f"expected an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise loc.error(full, f"expected {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _names(loc: Located, value, path: str) -> tuple[str, ...]:
    items = value if isinstance(value, list) else [value]
    for i, v in enumerate(items):
        p = f"{path}[{i}]" if isinstance(value, list) else path
        if not isinstance(v, str) or not NAME.match(v):
            raise loc.error(p, f"expected a value name (letters, digits, _), got {v!r}")
    return tuple(items)


def _parse_dims(loc: Located, data: dict) -> dict:
    dims = _get(loc, data, "dims", "", dict)
    out = {}
    for name, value in dims.items():
        path = f"dims.{name}"
        if not NAME.match(name):
            raise loc.error(path, f"dim names must be identifiers, got {name!r}")
        if value is None and name in NULLABLE_DIMS:
            out[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise loc.error(path, f"dim {name!r} must be a positive integer, got {value!r}")
        out[name] = value
    for name in REQUIRED_DIMS:
        if name not in out:
            typo = closest(name, [d for d in out if d not in REQUIRED_DIMS and d not in NULLABLE_DIMS])
            typo = f" ({typo!r} is not a dim name: a typo?)" if typo else ""
            raise loc.error("dims", f"missing dim {name!r}{typo} (a spec names: {', '.join(REQUIRED_DIMS)})")
    # The graph is built layer by layer, with one weight name per expert per layer, and the
    # rotary inverse frequencies are computed one by one: bound them so that an absurd value
    # is an error rather than minutes of work and gigabytes of names.
    if out["layers"] > MAX_LAYERS:
        raise loc.error("dims.layers", f"{out['layers']} layers; dsgraph builds at most {MAX_LAYERS}")
    if out["layers"] * out["experts"] > MAX_EXPERT_LAYERS:
        raise loc.error("dims.experts", f"{out['layers']} layers x {out['experts']} experts = "
                                        f"{out['layers'] * out['experts']} per-expert weight sets; dsgraph builds at "
                                        f"most {MAX_EXPERT_LAYERS} (DeepSeek-V3 has 61 x 256)")
    shared = out.get("shared_experts", 0)
    if out["layers"] * (out["experts"] + shared) > MAX_EXPERT_LAYERS:   # fuse_shared_experts: a slice each
        raise loc.error("dims.shared_experts", f"{out['layers']} layers x ({out['experts']} routed + {shared} shared "
                                               f"experts) = {out['layers'] * (out['experts'] + shared)} per-expert "
                                               f"weight sets; dsgraph builds at most {MAX_EXPERT_LAYERS}")
    if out["qk_rope_head_dim"] > MAX_ROPE_DIM:
        raise loc.error("dims.qk_rope_head_dim", f"rotary dim {out['qk_rope_head_dim']} is larger than the "
                                                 f"{MAX_ROPE_DIM} dsgraph tabulates")
    for name, value in out.items():   # after the bounds above, whose messages say more
        if value is not None and width_problem(value):
            raise loc.error(f"dims.{name}", f"dim {name!r}: {width_problem(value)}")
    if out["top_k"] > out["experts"]:
        raise loc.error("dims.top_k", f"top_k ({out['top_k']}) must be at most experts ({out['experts']}): a token "
                                      f"picks top_k distinct routed experts")
    if out["topk_groups"] > out["groups"]:
        raise loc.error("dims.topk_groups", f"topk_groups ({out['topk_groups']}) must be at most groups "
                                            f"({out['groups']})")
    if out["experts"] % out["groups"]:
        raise loc.error("dims.groups", f"experts ({out['experts']}) must divide into groups ({out['groups']})")
    if out["qk_rope_head_dim"] % 2:
        raise loc.error("dims.qk_rope_head_dim", "the rotary dim must be even")
    return out


def _parse_config(loc: Located, data: dict, name: str, model_type: str, dims: dict) -> ModelConfig:
    cfg = _get(loc, data, "config", "", dict)
    for key in cfg:
        if key not in ("rms_norm_eps", "tie_word_embeddings", "rope"):
            raise loc.error(f"config.{key}", f"unknown config key {key!r}"
                                             f"{did_you_mean(key, ('rms_norm_eps', 'tie_word_embeddings', 'rope'))}")
    eps = _get(loc, cfg, "rms_norm_eps", "config", float)
    if eps <= 0:
        raise loc.error("config.rms_norm_eps", "rms_norm_eps must be positive")
    if eps > FLOAT32_MAX:
        raise loc.error("config.rms_norm_eps", f"rms_norm_eps must be within float32 range (<= 3.4e38), got {eps!r}")
    tie = _get(loc, cfg, "tie_word_embeddings", "config", bool, required=False, default=False)
    rope_raw = _get(loc, cfg, "rope", "config", dict)
    fields = {"theta": float, "scaling": str, "factor": float, "original_max_position_embeddings": int,
              "beta_fast": float, "beta_slow": float, "mscale": float, "mscale_all_dim": float, "truncate": bool}
    values = {}
    for key in rope_raw:
        if key not in fields:
            raise loc.error(f"config.rope.{key}", f"unknown rope key {key!r}{did_you_mean(key, fields)} "
                                                        f"(known: {', '.join(fields)})")
    for key, kind in fields.items():
        if key in rope_raw:
            values[key] = _get(loc, rope_raw, key, "config.rope", kind)
    if values.get("scaling", "none") not in ("none", "yarn"):
        raise loc.error("config.rope.scaling", f"rope scaling must be none or yarn, got {values['scaling']!r}")
    if values.get("theta", 1.0) <= 0:
        raise loc.error("config.rope.theta", "theta must be positive")
    for key, value in values.items():
        # The rotary tables are computed in float32 (ir/rope.py), as transformers does.
        if fields[key] is float and abs(value) > FLOAT32_MAX:
            raise loc.error(f"config.rope.{key}", f"{key} must be within float32 range (|x| <= 3.4e38), got {value!r}")
    if values.get("scaling") == "yarn":
        for key in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow"):
            if key in values and values[key] <= 0:
                raise loc.error(f"config.rope.{key}", f"{key} must be positive, got {values[key]!r}")
        if values.get("factor", 1.0) < FLOAT32_MIN:
            raise loc.error("config.rope.factor", f"factor must be at least {FLOAT32_MIN:.3g} (a normal float32), "
                                                  f"got {values['factor']!r}")
        if values.get("theta", RopeConfig.theta) <= 1:
            raise loc.error("config.rope.theta", f"theta must be greater than 1 under yarn scaling (its ramp divides "
                                                 f"by log(theta)), got {values['theta']!r}")
    model = ModelConfig(name=name, model_type=model_type, dims_items=tuple(sorted(dims.items())),
                        rms_norm_eps=eps, tie_word_embeddings=tie, rope=RopeConfig(**values))
    # The kernels bake these two as float32 constants; YaRN's mscale terms can overflow them
    # (or, for a negative mscale, divide by zero).
    checks = (("the attention softmax scale qk_head_dim**-0.5 * mscale(factor, mscale_all_dim)**2",
               "config.rope.mscale_all_dim" if "mscale_all_dim" in rope_raw else "config.rope",
               lambda: model.softmax_scale),
              ("the rotary attention factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)",
               "config.rope", lambda: attention_factor(model.rope)))
    for what, path, compute in checks:
        try:
            value = compute()
        except ZeroDivisionError:
            value = math.inf
        if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
            raise loc.error(path, f"{what} is {value:.3g}, beyond float32 range")
    return model


def _parse_plan(loc: Located, data: dict, dims: dict) -> LayerPlan:
    plan = _get(loc, data, "layer_plan", "", dict)
    for key in plan:
        if key not in ("first_k_dense_replace", "moe_layer_freq", "dense_layer", "moe_layer"):
            raise loc.error(f"layer_plan.{key}", f"unknown layer_plan key {key!r}")
    first = _get(loc, plan, "first_k_dense_replace", "layer_plan", int)
    freq = _get(loc, plan, "moe_layer_freq", "layer_plan", int)
    if first < 0:
        raise loc.error("layer_plan.first_k_dense_replace", "must be >= 0")
    if freq < 1:
        raise loc.error("layer_plan.moe_layer_freq", "must be >= 1")
    kinds = {}
    for key in ("dense_layer", "moe_layer"):
        raw = _get(loc, plan, key, "layer_plan", dict)
        for k in raw:
            if k not in ("attention", "ffn"):
                raise loc.error(f"layer_plan.{key}.{k}", f"unknown key {k!r} (a layer names its attention and ffn blocks)")
        kinds[key] = LayerKind(_get(loc, raw, "attention", f"layer_plan.{key}", str),
                               _get(loc, raw, "ffn", f"layer_plan.{key}", str))
    return LayerPlan(first, freq, kinds["dense_layer"], kinds["moe_layer"])


def _parse_weight_formats(loc: Located, data: dict) -> tuple[tuple[str, str], ...]:
    """The optional ``weight_formats:`` map: a glob over bound checkpoint names ({layer} and {expert}
    formatted; a per-expert stack is named with ``*`` for the expert) -> the storage format of the
    weights it matches, first match wins.  A quantised format (ir/formats.py) or ``act``: stored in the
    activation dtype (what an unmatched weight is), to carve exceptions out of a later, wider glob:

        weight_formats:
          "model.layers.*.mlp.gate.weight": act
          "model.layers.*_proj*.weight": fp8_e4m3_block128
    """
    raw = _get(loc, data, "weight_formats", "", dict, required=False, default={})
    out = []
    for pattern, name in raw.items():
        path = f"weight_formats.{pattern}"
        if not isinstance(name, str) or (name != ACT and (name not in FORMATS or not FORMATS[name].quantized)):
            quantised = [n for n, f in FORMATS.items() if f.quantized]
            raise loc.error(path, f"weight format must be {ACT} (the activation dtype) or one of "
                                  f"{', '.join(quantised)}; got {name!r}")
        out.append((pattern, name))
    return tuple(out)


def _parse_op(loc: Located, raw, path: str, dims: dict) -> OpDecl:
    if not isinstance(raw, dict):
        raise loc.error(path, f"an op is a mapping like {{op: linear, in: x, out: y}}, got {raw!r}")
    op = _get(loc, raw, "op", path, str)
    if op != "call" and op not in OPS:
        raise loc.error(f"{path}.op", f"unknown op {op!r}{did_you_mean(op, ['call', *OPS])} "
                                      f"(known: call, {', '.join(sorted(OPS))})")
    if "in" not in raw:
        raise loc.error(path, f"op {op!r} needs 'in'")
    if "out" not in raw:
        raise loc.error(path, f"op {op!r} needs 'out'")
    inputs = _names(loc, raw["in"], f"{path}.in")
    outputs = _names(loc, raw["out"], f"{path}.out")
    rest = {k: v for k, v in raw.items() if k not in ("op", "in", "out")}
    if op == "call":
        for key in rest:
            if key != "block":
                raise loc.error(f"{path}.{key}", f"unknown attribute {key!r} for call (it takes: block)")
        block = _get(loc, raw, "block", path, str)
        return OpDecl("call", inputs, outputs, {"block": block}, {}, path)
    opdef = OPS[op]
    low, high = opdef.inputs if isinstance(opdef.inputs, tuple) else (opdef.inputs, opdef.inputs)
    if not low <= len(inputs) <= high:
        takes = str(low) if low == high else f"{low} to {high}"
        raise loc.error(f"{path}.in", f"op {op!r} takes {takes} input(s), got {len(inputs)}")
    attrs, weights = {}, {}
    for key, value in rest.items():
        if key in opdef.weights:
            if not isinstance(value, str) or not value:
                raise loc.error(f"{path}.{key}", f"a weight is a checkpoint tensor name, got {value!r}")
            names = set(PLACEHOLDER.findall(value))
            allowed = {"layer", "expert"} if key in opdef.expert_weights else {"layer"}
            if names - allowed:
                raise loc.error(f"{path}.{key}", f"unknown placeholder(s) {sorted(names - allowed)} in {value!r} "
                                                 f"(allowed: {', '.join('{' + a + '}' for a in sorted(allowed))})")
            if key in opdef.expert_weights and "expert" not in names:
                raise loc.error(f"{path}.{key}", f"per-expert weight {value!r} must contain {{expert}}")
            try:
                value.format(layer=0, expert=0)
            except (ValueError, IndexError, KeyError) as exc:
                raise loc.error(f"{path}.{key}", f"weight name {value!r} is not a valid name template "
                                                 f"({exc}; write literal braces as {{{{ and }}}})") from None
            weights[key] = value
        elif key in opdef.attrs:
            try:
                attrs[key] = opdef.attrs[key].parse(value, dims)
            except AttrError as exc:
                raise loc.error(f"{path}.{key}", f"attribute {key!r} of {op}: {exc}") from None
        else:
            known = sorted(set(opdef.attrs) | set(opdef.weights))
            raise loc.error(f"{path}.{key}", f"unknown attribute {key!r} for op {op!r}{did_you_mean(key, known)} "
                                                 f"(it takes: {', '.join(known) or 'nothing'})")
    for key, spec in opdef.attrs.items():
        if key not in attrs:
            if spec.required:
                raise loc.error(path, f"op {op!r} needs attribute {key!r}")
            attrs[key] = spec.default
    for role, required in opdef.weights.items():
        if required and role not in weights:
            raise loc.error(path, f"op {op!r} needs weight {role!r}")
    if opdef.outputs != -1 and len(outputs) != opdef.outputs:
        raise loc.error(f"{path}.out", f"op {op!r} makes {opdef.outputs} output(s), got {len(outputs)}")
    if op == "split" and len(outputs) != len(attrs["sizes"]):
        raise loc.error(f"{path}.out", f"split has {len(attrs['sizes'])} sizes but {len(outputs)} outputs")
    return OpDecl(op, inputs, outputs, attrs, weights, path)


def _parse_blocks(loc: Located, data: dict, dims: dict) -> dict[str, Block]:
    raw_blocks = _get(loc, data, "blocks", "", dict)
    blocks = {}
    for name, raw in raw_blocks.items():
        path = f"blocks.{name}"
        if not isinstance(raw, dict):
            raise loc.error(path, "a block is a mapping with inputs, outputs and ops")
        for key in raw:
            if key not in ("inputs", "outputs", "ops"):
                raise loc.error(f"{path}.{key}", f"unknown block key {key!r} (a block has inputs, outputs, ops)")
        inputs = _names(loc, _get(loc, raw, "inputs", path, list), f"{path}.inputs")
        outputs = _names(loc, _get(loc, raw, "outputs", path, list), f"{path}.outputs")
        ops_raw = _get(loc, raw, "ops", path, list)
        if not ops_raw:
            raise loc.error(f"{path}.ops", "a block needs at least one op")
        ops = tuple(_parse_op(loc, op, f"{path}.ops[{i}]", dims) for i, op in enumerate(ops_raw))
        defined = set(inputs)
        for decl in ops:
            for i, v in enumerate(decl.inputs):
                if v not in defined:
                    p = f"{decl.path}.in" + (f"[{i}]" if len(decl.inputs) > 1 else "")
                    raise loc.error(p, f"undefined value {v!r}{did_you_mean(v, defined)} "
                                             f"(defined so far: {', '.join(sorted(defined))})")
            for v in decl.outputs:
                if v in defined:
                    raise loc.error(f"{decl.path}.out", f"value {v!r} is defined twice")
                defined.add(v)
        for i, v in enumerate(outputs):
            if v not in defined:
                raise loc.error(f"{path}.outputs[{i}]", f"block output {v!r} is never computed")
        blocks[name] = Block(name, inputs, outputs, ops, path)
    for name in REQUIRED_BLOCKS:
        if name not in blocks:
            raise loc.error("blocks", f"missing block {name!r} (a spec has: {', '.join(REQUIRED_BLOCKS)})")
    return blocks


def _check_calls(loc: Located, blocks: dict, plan: LayerPlan) -> None:
    for kind_name, kind in (("dense_layer", plan.dense_layer), ("moe_layer", plan.moe_layer)):
        for role in ("attention", "ffn"):
            target = getattr(kind, role)
            if target not in blocks:
                raise loc.error(f"layer_plan.{kind_name}.{role}", f"unknown block {target!r}")
    for block in blocks.values():
        for decl in block.ops:
            if decl.op != "call":
                continue
            target = decl.attrs["block"]
            if target in ("{attention}", "{ffn}"):
                continue
            if target not in blocks:
                raise loc.error(f"{decl.path}.block", f"unknown block {target!r}")
            if target == block.name:
                raise loc.error(f"{decl.path}.block", f"block {target!r} calls itself")

    # Walk the calls as the graph builder will inline them, so a cycle (possibly through
    # {attention}/{ffn}) or a layer placeholder outside a decoder layer is a located error
    # here rather than a RecursionError or AttributeError there.
    def walk(name: str, kind: LayerKind | None, stack: list[str]) -> None:
        for decl in blocks[name].ops:
            if decl.op != "call":
                continue
            target = decl.attrs["block"]
            if target in ("{attention}", "{ffn}"):
                if kind is None:
                    raise loc.error(f"{decl.path}.block", f"{target} names a block of the layer plan; it can only be "
                                                          f"called inside decoder_layer, but block {name!r} runs outside one")
                target = getattr(kind, target[1:-1])
            if target in stack:
                cycle = " -> ".join(stack[stack.index(target):] + [target])
                raise loc.error(f"{decl.path}.block", f"blocks call each other in a cycle: {cycle}")
            walk(target, kind, stack + [target])

    walk("embed", None, ["embed"])
    walk("head", None, ["head"])
    for kind in (plan.dense_layer, plan.moe_layer):
        walk("decoder_layer", kind, ["decoder_layer"])


def parse_spec(text: str, file: str = "<spec>") -> Spec:
    """Parse and validate names and structure (no shape inference; see load_spec)."""
    loc = load_located(text, file)
    data = loc.data
    if not isinstance(data, dict):
        raise loc.error("", "a spec is a mapping with schema, name, model_type, dims, config, layer_plan, blocks")
    if "schema" not in data and {"architectures", "hidden_size", "_name_or_path"} & set(data):
        raise loc.error("", "this is a Hugging Face config.json, not a dsgraph spec: write a spec from it with "
                            "`dsgraph spec --from-config CONFIG.json -o spec.yaml`, or give the checkpoint folder "
                            "(--model DIR, Engine.from_pretrained(DIR)), whose spec is written from its config.json")
    for key in data:
        if key not in TOP_KEYS:
            raise loc.error(key, f"unknown top-level key {key!r}{did_you_mean(key, TOP_KEYS)} "
                                 f"(known: {', '.join(sorted(TOP_KEYS))})")
    schema = _get(loc, data, "schema", "", int)
    if schema != SCHEMA:
        raise loc.error("schema", f"this dsgraph reads spec schema {SCHEMA}, the file says {schema}")
    name = _get(loc, data, "name", "", str)
    model_type = _get(loc, data, "model_type", "", str)
    if model_type not in MODEL_TYPES:
        raise loc.error("model_type", f"model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
    dims = _parse_dims(loc, data)
    model = _parse_config(loc, data, name, model_type, dims)
    plan = _parse_plan(loc, data, dims)
    blocks = _parse_blocks(loc, data, dims)
    _check_calls(loc, blocks, plan)
    return Spec(file=file, text=text, model=model, plan=plan, blocks=blocks, located=loc,
                weight_formats=_parse_weight_formats(loc, data))


def load_spec(path_or_text: str, *, file: str | None = None, check: bool = True) -> Spec:
    """Load a spec from a path (or from YAML text when ``file`` is given) and check it builds."""
    if file is None:
        try:
            with open(path_or_text, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise SpecError(f"cannot read spec: {exc.strerror}", file=str(path_or_text)) from None
        file = os.path.basename(str(path_or_text))
    else:
        text = path_or_text
    spec = parse_spec(text, file)
    if check:
        from .graph import build_graph
        build_graph(spec, "prefill")
    return spec
