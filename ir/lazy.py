"""torch and networkx, imported the first time they are used.

The compile path (spec -> graph -> passes -> codegen -> NVRTC) never touches a tensor, so
`dsgraph compile` works where torch is not installed: only the reference semantics
(``OpDef.run``, the rotary tables) need torch.  And loading or checking a spec
(``ir.spec``) needs no graph library until a graph is built.  Modules write ``torch.x``,
``F.x`` and ``nx.x`` as usual through these stand-ins, which import the real module on
the first attribute read.
"""
from __future__ import annotations

import importlib


class LazyModule:
    """Stands in for the module ``name`` until one of its attributes is read."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        # Only reached for attributes this object lacks, i.e. the module's own.
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
nx = LazyModule("networkx")
