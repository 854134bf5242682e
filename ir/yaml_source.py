"""Read YAML while remembering where every entry came from.

PyYAML's composer keeps a line mark on every node; we walk the node tree once,
build plain Python values and a table ``path -> line`` so later stages can say
"deepseek_v2_lite.yaml:42 at blocks.mla.ops[3].in".
"""
from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from .errors import SpecError


@dataclass
class Located:
    """Plain data plus the source line of each YAML path."""

    data: object
    file: str
    lines: dict[str, int] = field(default_factory=dict)

    def line(self, path: str) -> int | None:
        # Fall back to the nearest enclosing entry that has a line.
        while path:
            if path in self.lines:
                return self.lines[path]
            cut = max(path.rfind("."), path.rfind("["))
            path = path[:cut] if cut > 0 else ""
        return self.lines.get("", None)

    def error(self, path: str, message: str) -> SpecError:
        return SpecError(message, file=self.file, path=path, line=self.line(path))


def _convert(node, path: str, lines: dict[str, int], file: str):
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            key = _scalar(key_node) if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                raise SpecError(f"mapping keys must be strings, got {key!r}", file=file, path=path,
                                line=key_node.start_mark.line + 1)
            if key in out:
                raise SpecError(f"duplicate key {key!r}", file=file, path=path, line=key_node.start_mark.line + 1)
            child = f"{path}.{key}" if path else key
            out[key] = _convert(value_node, child, lines, file)
            # An entry's line is its key's: a block mapping or list value starts a line below it.
            lines[child] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(v, f"{path}[{i}]", lines, file) for i, v in enumerate(node.value)]
    return _scalar(node)


def _scalar(node):
    # The safe constructor resolves ints, floats, bools and nulls as YAML 1.1 does.
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def load_located(text: str, file: str = "<spec>") -> Located:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"not valid YAML: {problem}", file=file, line=line) from None
    if root is None:
        raise SpecError("the spec is empty", file=file, line=1)
    lines: dict[str, int] = {}
    data = _convert(root, "", lines, file)
    return Located(data=data, file=file, lines=lines)
