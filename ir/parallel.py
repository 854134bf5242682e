"""How a model is spread over `world` ranks: the one table of which weight is split how.

DeepSeek's own reference recipe (as vLLM also runs it), every rank holding the activations
whole:

    MLA             q_proj / q_b_proj rows and kv_b_proj rows split by heads (H / world heads a
                    rank), o_proj columns split the same way; q_a / kv_a projections, their norms
                    and the latent cache replicated                    -> all-reduce after o_proj
    dense FFN       gate / up rows split, down columns split           -> all-reduce after down
    MoE             router (and its bias) replicated; routed experts partitioned (expert
                    parallel: rank r owns experts [r E/world, (r+1) E/world)); shared experts
                    split like the dense FFN                           -> one all-reduce after
                                                                          routed + shared
    the rest        embedding, norms, lm_head replicated

Used by the sharding pass, by the weight loader (each rank reads only its slice) and by the
planner (per-GPU bytes), so the three cannot disagree.  Dimension legend: H heads, N/R/V head
dims, I dense intermediate, M moe intermediate, E routed experts, S shared experts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import DsgraphError


class ParallelError(DsgraphError, ValueError):
    """A model cannot be spread over this many ranks (or the ranks disagree)."""


# Checkpoint weight name (suffix after "model.layers.{layer}.") -> how it is split.
#   ("rows", what)  dim 0 split evenly, what = the dim that must divide by world
#   ("cols", what)  dim 1 split evenly
#   ("experts",)    per-expert tensors: whole on the rank that owns the expert, absent elsewhere
# Anything not listed is replicated.
_RULES: list[tuple[re.Pattern, tuple]] = [
    (re.compile(r"\.self_attn\.q_proj\.weight$"), ("rows", "heads")),
    (re.compile(r"\.self_attn\.q_b_proj\.weight$"), ("rows", "heads")),
    (re.compile(r"\.self_attn\.kv_b_proj\.weight$"), ("rows", "heads")),
    (re.compile(r"\.self_attn\.o_proj\.weight$"), ("cols", "heads")),
    (re.compile(r"\.mlp\.(gate_proj|up_proj)\.weight$"), ("rows", "intermediate")),
    (re.compile(r"\.mlp\.down_proj\.weight$"), ("cols", "intermediate")),
    (re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj)\.weight$"), ("rows", "shared_intermediate")),
    (re.compile(r"\.mlp\.shared_experts\.down_proj\.weight$"), ("cols", "shared_intermediate")),
    (re.compile(r"\.mlp\.experts\.(\d+|\*|\{expert\})\.(gate_proj|up_proj|down_proj)\.weight$"), ("experts",)),
]


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds of one weight.

    kind: "replicated" (all of it), "rows" / "cols" (elements [start, stop) along dim 0 / 1),
    "experts" (the experts [start, stop) of a per-expert weight; a single expert's tensor is
    `held` only on its owner)."""
    kind: str
    start: int = 0
    stop: int = 0

    @property
    def dim(self) -> int | None:
        return {"rows": 0, "cols": 1}.get(self.kind)


REPLICATED = Shard("replicated")


def split_sizes(model) -> dict[str, int]:
    """The dims that are split, by the name the rules use."""
    d = model.dims
    return {"heads": d["heads"], "intermediate": d["intermediate"], "experts": d["experts"],
            "shared_intermediate": d["moe_intermediate"] * d["shared_experts"]}


def parallel_problems(spec, world: int) -> list[str]:
    """Why the model of `spec` (an ir.Spec) cannot run on `world` ranks (empty: it can)."""
    model = spec.model
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        return [f"the number of ranks must be a whole number >= 1, got {world!r}"]
    if world == 1:
        return []
    out = []
    names = {"heads": "heads (num_attention_heads)", "intermediate": "dense intermediate (intermediate_size)",
             "experts": "routed experts (n_routed_experts)",
             "shared_intermediate": "shared-expert width (moe_intermediate_size x n_shared_experts)"}
    for key, size in split_sizes(model).items():
        if key == "intermediate" and not _has_dense_layers(spec):
            continue
        if key in ("experts", "shared_intermediate") and not _has_moe_layers(spec):
            continue
        if size % world:
            out.append(f"{names[key]} = {size} does not divide by {world} ranks")
    return out


def check_parallel(spec, world: int) -> None:
    """Raise ParallelError (one line, every reason) if the model of `spec` cannot run on `world` ranks."""
    problems = parallel_problems(spec, world)
    if problems:
        raise ParallelError(f"{spec.name} cannot run on {world} ranks: " + "; ".join(problems))


def _layers(spec) -> range:
    return range(spec.dims["layers"])


def _has_dense_layers(spec) -> bool:
    return any(spec.plan.kind(layer)[0] == "dense" for layer in _layers(spec))


def _has_moe_layers(spec) -> bool:
    return any(spec.plan.kind(layer)[0] == "moe" for layer in _layers(spec))


def rule_for(name: str) -> tuple | None:
    for pattern, rule in _RULES:
        if pattern.search(name):
            return rule
    return None


def weight_shard(name: str, shape: tuple[int, ...], model, world: int, rank: int) -> Shard:
    """What rank `rank` holds of weight `name` (shape as in the checkpoint; for a stacked
    per-expert weight, [E, ...])."""
    if world == 1:
        return REPLICATED
    rule = rule_for(name)
    if rule is None:
        return REPLICATED
    if rule[0] == "experts":
        per = model.dims["experts"] // world
        return Shard("experts", rank * per, (rank + 1) * per)
    kind, what = rule
    dim = 0 if kind == "rows" else 1
    total = shape[dim]
    if total % world:
        raise ParallelError(f"weight {name} {tuple(shape)}: dim {dim} = {total} does not divide by {world} ranks")
    per = total // world
    return Shard(kind, rank * per, (rank + 1) * per)


def sharded_shape(shape: tuple[int, ...], shard: Shard) -> tuple[int, ...]:
    """The shape of the part a rank holds."""
    if shard.kind in ("rows", "cols"):
        out = list(shape)
        out[shard.dim] = shard.stop - shard.start
        return tuple(out)
    if shard.kind == "experts" and shape:
        return (shard.stop - shard.start, *shape[1:])
    return tuple(shape)


def expert_owner(expert: int, model, world: int) -> int:
    return expert // (model.dims["experts"] // world)
