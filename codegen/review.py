"""What a reviewer sees: the generated CUDA of two sides, paired by role and diffed.

A side is what reaches NVRTC for each spec: every kernel source and every dsgraph header
those sources include (plus, for a compiled bundle, its launch plan).  Kernels are paired
by what they are for, not by their names (which carry dims): first by role (family[.stage])
and the spec ops they implement, then by role and op names, then by role alone when that
leaves one kernel on each side.  So a changed rope factor, or V2-Lite against V3, reads as
kernels *changed*, not as files removed and added.  A change of weight storage format (a spec's
weight_formats) is one summary line per kind of change.  The summary comes first.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from .render import parse_header

_IMPLEMENTS = re.compile(r"^\S+ (\S+) (\S+?)(?:,| \()")   # "file:line path op, layers ... (passes)"
# What a reviewer does not need to see change: the compiler hash (it differs on every commit)
# and where in which spec file an op sits (comparing two spec files, or a spec edited above).
_COMPILER_LINE = re.compile(r"^// compiler: .*\n", re.MULTILINE)
_SPEC_LOCATION = re.compile(r"^(//   )\S+:\d+ ", re.MULTILINE)


def _normal(source: str) -> str:
    return _SPEC_LOCATION.sub(r"\1", _COMPILER_LINE.sub("", source))


@dataclass
class Side:
    label: str
    kernels: dict[str, dict[str, str]]           # spec name -> kernel name -> source
    headers: dict[str, str] = field(default_factory=dict)   # header name -> text
    plans: dict[str, str] = field(default_factory=dict)     # spec name -> launch plan text (bundles)
    # spec name -> {bound weight: its storage format, "act" for the activation dtype} (specs and bundles)
    formats: dict[str, dict[str, str]] = field(default_factory=dict)


def _role(source: str) -> tuple[str, tuple, tuple]:
    """(role, (op, path) pairs, op names) from a generated file's header."""
    h = parse_header(source)
    role = h.get("role") or h.get("template", "?")
    sites = []
    for line in h.get("implements", []):
        m = _IMPLEMENTS.match(line)
        if m:
            sites.append((m.group(2), m.group(1)))
    return role, tuple(sorted(set(sites))), tuple(sorted({op for op, _ in sites}))


def pair_kernels(a: dict[str, str], b: dict[str, str]) -> list[tuple[str | None, str | None]]:
    """[(name in a or None, name in b or None)]: same name first, then by role (see module doc)."""
    pairs = [(n, n) for n in sorted(set(a) & set(b))]
    left, right = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    roles_a = {n: _role(a[n]) for n in left}
    roles_b = {n: _role(b[n]) for n in right}
    for key in (lambda r: (r[0], r[1]), lambda r: (r[0], r[2]), lambda r: r[0]):
        groups_a: dict = {}
        groups_b: dict = {}
        for n in left:
            groups_a.setdefault(key(roles_a[n]), []).append(n)
        for n in right:
            groups_b.setdefault(key(roles_b[n]), []).append(n)
        for k, names in groups_a.items():
            if len(names) == 1 and len(groups_b.get(k, ())) == 1:
                pairs.append((names[0], groups_b[k][0]))
        paired_a = {p[0] for p in pairs}
        paired_b = {p[1] for p in pairs}
        left = [n for n in left if n not in paired_a]
        right = [n for n in right if n not in paired_b]
    pairs += [(n, None) for n in left] + [(None, n) for n in right]
    return pairs


def _same(x: str, y: str) -> bool:
    return _normal(x) == _normal(y)


def _unified(x: str, y: str, name_a: str, name_b: str) -> list[str]:
    x, y = _normal(x), _normal(y)
    return list(difflib.unified_diff(x.splitlines(keepends=True), y.splitlines(keepends=True),
                                     fromfile=name_a, tofile=name_b))


@dataclass
class Report:
    summary: list[str]
    diff: list[str]
    differs: bool


def compare(a: Side, b: Side) -> Report:
    """Pair specs by name (a single spec on each side is paired whatever its name), then
    kernels by role; headers by name; launch plans when both sides have one."""
    specs = sorted(set(a.kernels) | set(b.kernels))
    if len(a.kernels) == 1 and len(b.kernels) == 1:
        spec_pairs = [(next(iter(a.kernels)), next(iter(b.kernels)))]
    else:
        spec_pairs = [(s if s in a.kernels else None, s if s in b.kernels else None) for s in specs]
    counts = {"changed": 0, "added": 0, "removed": 0, "identical": 0}
    listed: list[str] = []
    diff: list[str] = []
    for sa, sb in spec_pairs:
        ka, kb = a.kernels.get(sa, {}), b.kernels.get(sb, {})
        prefix = "" if len(spec_pairs) == 1 else f"{sa or sb}/"
        for na, nb in pair_kernels(ka, kb):
            if na and nb and _same(ka[na], kb[nb]):
                counts["identical"] += 1
                continue
            label = "changed" if na and nb else ("removed" if na else "added")
            counts[label] += 1
            shown = f"{prefix}{na}" if na == nb or not nb else (f"{prefix}{nb}" if not na else f"{prefix}{na} -> {nb}")
            listed.append(f"  {label:<8} {shown}")
            diff += _unified(ka.get(na, ""), kb.get(nb, ""), f"a/{prefix}{na}.cu" if na else "/dev/null",
                             f"b/{prefix}{nb}.cu" if nb else "/dev/null")
        pa, pb = a.plans.get(sa), b.plans.get(sb)
        if pa is not None and pb is not None and pa != pb:
            plan_diff = _unified(pa, pb, f"a/{prefix}launch-plan", f"b/{prefix}launch-plan")
            listed.append(f"  {'changed':<8} {prefix}launch plan "
                          f"({sum(1 for l in plan_diff if l[:1] in '+-' and l[:3] not in ('+++', '---'))} lines)")
            diff += plan_diff
        fa, fb = a.formats.get(sa), b.formats.get(sb)
        if fa is not None and fb is not None:
            listed += format_changes(fa, fb, prefix)
    header_changes = []
    for name in sorted(set(a.headers) | set(b.headers)):
        x, y = a.headers.get(name), b.headers.get(name)
        if x == y:
            continue
        label = "changed" if x is not None and y is not None else ("removed" if x is not None else "added")
        users = sorted({f"{s}/{k}" if len(spec_pairs) > 1 else k for side in (a, b)
                        for s, ks in side.kernels.items() for k, src in ks.items()
                        if name in parse_header(src).get("includes", "").split(", ")})
        header_changes.append(f"  {label:<8} include/{name} (included by {len(users)} kernel(s)"
                              f"{': ' + ', '.join(users[:6]) + (' ...' if len(users) > 6 else '') if users else ''})")
        diff += _unified(x or "", y or "", f"a/include/{name}" if x is not None else "/dev/null",
                         f"b/include/{name}" if y is not None else "/dev/null")
    summary = [f"{a.label} -> {b.label}: {counts['changed']} changed, {counts['added']} added, "
               f"{counts['removed']} removed, {counts['identical']} identical kernels; "
               f"{len(header_changes)} header(s) changed"]
    summary += listed + header_changes
    differs = bool(listed or header_changes)
    return Report(summary, diff, differs)


def format_changes(a: dict[str, str], b: dict[str, str], prefix: str = "") -> list[str]:
    """One summary line per change of storage format (e.g. act -> fp8_e4m3_block128) among the weights both
    sides bind: how many weights changed so, and the first few of them."""
    moves: dict[tuple[str, str], list[str]] = {}
    for name in sorted(set(a) & set(b)):
        if a[name] != b[name]:
            moves.setdefault((a[name], b[name]), []).append(name)
    return [f"  {'changed':<8} {prefix}weight format {fa} -> {fb}: {len(names)} weight(s) "
            f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''})" for (fa, fb), names in sorted(moves.items())]


def weight_formats(weights: dict) -> dict[str, str]:
    """{weight: format or "act"} from a graph's weights table (WeightInfo) or a manifest's (dicts); the
    companions (scales) are left out: they come and go with their weight's format."""
    out, companions = {}, set()
    for name, w in weights.items():
        fmt = w.get("format") if isinstance(w, dict) else w.format
        out[name] = fmt or "act"
        if fmt:
            from ir.formats import FORMATS, companion_names
            companions.update(companion_names(name, FORMATS[fmt]))
    return {n: f for n, f in out.items() if n not in companions}


def plan_text(manifest_phases: dict) -> str:
    """A bundle's launch plan, one line per step, for diffing: what runs, with what arguments."""
    lines = []
    for phase in sorted(manifest_phases):
        lines.append(f"[{phase}]")
        for s in manifest_phases[phase]["steps"]:
            if s["type"] == "kernel":
                args = ", ".join(f"{a['name']}={next(iter(a['ref'].values()))}" for a in s["args"])
                pdl = " pdl" if s.get("pdl") else ""
                lines.append(f"{s['kernel']} grid={s['grid']} block={s['block']} smem={s['smem']}{pdl} ({args})")
            else:
                lines.append(f"{s['call']} {s['node']} {s['inputs']} -> {s['outputs']} {s['weights']} {s['attrs']}")
    return "\n".join(lines) + "\n"
