"""eliminate_dead: drop ops whose results nobody reads.

A node lives if it makes a graph output, makes a ``state`` (a cache write is its own
reason to run: decode reads the rows later even when this graph does not), or makes
a value a living node reads.  Weights only dead nodes bound are dropped too, so the
loader does not ask the checkpoint for them.
"""
from __future__ import annotations

import networkx as nx

from ..graph import topo_order
from .rewrite import copy_graph, prune_values, prune_weights, remove_nodes


def eliminate_dead(G: nx.DiGraph) -> nx.DiGraph:
    """Remove nodes with no living reader.

    before                         after

      x --> linear --> y (read)      x --> linear --> y (read)
       \\
        --> linear --> z (unread, not an output, not a state)   (removed, with its weight)
    """
    G = copy_graph(G)
    values = G.graph["values"]
    wanted = set(G.graph["outputs"])
    dead = []
    for nid in reversed(topo_order(G)):
        data = G.nodes[nid]
        if any(v in wanted or values[v].dtype == "state" for v in data["outputs"]):
            wanted.update(data["inputs"])
        else:
            dead.append(nid)
    remove_nodes(G, dead)
    prune_values(G)
    prune_weights(G)
    return G
