"""What a phase runs, as data: the ordered steps, the buffer plan and what each node needs.

Made by lowering (codegen.lower) from a graph, written to and read back from a bundle's
manifest (codegen.manifest); the runtime runs it with no graph, no passes and no lowering.
No networkx here, so loading a bundle never imports the compiler's graph machinery.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .kernel import KernelLaunch, LibraryCall


@dataclass(frozen=True)
class View:
    base: str                    # the value whose storage this one shares (never itself a view)
    offset: int                  # element offset into base's storage
    strides: tuple[int | str, ...]  # element strides, one per dim (symbolic for dim 0 never needed)


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int | str, ...]  # first dim may be symbolic: "T", "T*6"
    dtype: str                   # act | f32 | i64 | i32 | state | routing
    view: View | None = None
    layer: int | None = None     # state: whose cache
    parts: tuple[str, ...] = ()  # routing: its two int32 buffers

    @property
    def allocated(self) -> bool:
        return self.view is None and self.dtype not in ("state", "routing")


@dataclass(frozen=True)
class NodeInfo:
    """What the runtime needs of a graph node to run its steps without the graph."""
    layer: int | None            # whose KV cache its launches bind to ctx kv_cache
    outputs: tuple[str, ...]     # values it makes (allocated or aliased before its steps run)


@dataclass
class PhasePlan:
    phase: str
    steps: list = field(default_factory=list)          # KernelLaunch | LibraryCall, in order
    buffers: dict[str, Buffer] = field(default_factory=dict)
    nodes: dict[str, NodeInfo] = field(default_factory=dict)   # every node a step serves
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    unlowered: list[tuple[str, str]] = field(default_factory=list)  # (node, op), strict=False only
    arena: tuple = ()            # codegen.memplan.Slot: what the step allocates, with lifetimes

    @property
    def launches(self) -> list[KernelLaunch]:
        return [s for s in self.steps if isinstance(s, KernelLaunch)]

    @property
    def library_calls(self) -> list[LibraryCall]:
        return [s for s in self.steps if isinstance(s, LibraryCall)]
