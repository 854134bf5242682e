"""The pass pipeline: the table of contents of the compiler (filled in by the codegen issue)."""
from __future__ import annotations

import networkx as nx


def run_pipeline(G: nx.DiGraph) -> nx.DiGraph:
    return G
