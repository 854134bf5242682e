"""Provenance: which spec ops a kernel implements, at which lines, fused by which passes.

Every graph node the builder makes has a SpecSite (op, YAML path, line; ir.graph); a node a
pass makes lists the builder nodes it stands for (``sources``) and the passes that made it
(``passes``).  Lowering turns that into ``Origin`` records on each launch; a generated file's
header summarises them one line per spec op, with the layers that use the kernel folded
into ranges, so a kernel shared by 61 layers still has a short header.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER_PREFIX = re.compile(r"^L(\d+)\.")


def natural_key(name: str) -> list:
    """Sort key that orders L2 before L10 (reviewers read node lists layer by layer)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class Origin:
    """One spec op a launch implements, in one layer."""
    file: str                    # the spec file name
    line: int | None
    path: str                    # YAML path, e.g. "blocks.mla.ops[4]"
    op: str                      # the spec op, e.g. "rms_norm"
    layer: int | None
    passes: tuple[str, ...]      # the passes that fused it into this node, in pipeline order

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "path": self.path, "op": self.op,
                "layer": self.layer, "passes": list(self.passes)}

    @classmethod
    def from_json(cls, d: dict) -> "Origin":
        return cls(d["file"], d["line"], d["path"], d["op"], d["layer"], tuple(d["passes"]))


def node_origins(G, nid: str) -> tuple[Origin, ...]:
    """The Origins of graph node `nid` (empty for graphs built without a spec)."""
    table = G.graph.get("origins") or {}
    data = G.nodes[nid]
    passes = data.get("passes", {})
    out = []
    for src in data.get("sources", [nid]):
        site = table.get(src)
        if site is not None:
            out.append(Origin(G.graph.get("spec_file", "<spec>"), site.line, site.path, site.op, site.layer,
                              tuple(passes.get(src, ()))))
    return tuple(out)


def fold_ranges(numbers) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    nums = sorted(set(numbers))
    parts, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(parts)


def summary_lines(origins) -> list[str]:
    """One line per spec op: "file:line path op, layers 0-26 (pass, pass)"."""
    groups: dict[tuple, set] = {}
    for o in origins:
        groups.setdefault((o.file, o.line, o.path, o.op, o.passes), set()).add(o.layer)
    lines = []
    for (file, line, path, op, passes), layers in sorted(
            groups.items(), key=lambda kv: (kv[0][1] or 0, kv[0][2], kv[0][4])):
        where = f"{file}:{line}" if line is not None else file
        real = [x for x in layers if x is not None]
        text = f"{where} {path} {op}"
        if real:
            text += f", layer{'s' if len(real) > 1 else ''} {fold_ranges(real)}"
        text += f" ({', '.join(passes)})" if passes else " (as written)"
        lines.append(text)
    return lines


def fold_nodes(nodes) -> str:
    """Graph node ids with their layer prefixes folded: "L0-26.mla.c_n, embed.x"."""
    by_rest: dict[str, list[int]] = {}
    plain: list[str] = []
    for n in nodes:
        m = _LAYER_PREFIX.match(n)
        if m:
            by_rest.setdefault(n[m.end():], []).append(int(m.group(1)))
        else:
            plain.append(n)
    folded = [f"L{fold_ranges(ls).replace(', ', ',')}.{rest}" for rest, ls in by_rest.items()]
    return ", ".join(sorted(plain, key=natural_key) + sorted(folded, key=lambda s: natural_key(s.split(".", 1)[1])))


def role_key(origins) -> tuple:
    """What a kernel implements, independent of lines, layers and dims: (op, YAML path) pairs."""
    return tuple(sorted({(o.op, o.path) for o in origins}))
