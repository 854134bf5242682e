"""dsgraph's front end: spec -> graph -> passes, with reference semantics for every op."""
from .errors import GraphError, SpecError
from .graph import PHASES, build_graph, topo_order
from .interpret import run_graph
from .spec import Spec, load_spec, parse_spec
from .verify import verify

__all__ = ["GraphError", "SpecError", "PHASES", "Spec", "build_graph", "load_spec", "parse_spec", "run_graph",
           "topo_order", "verify"]
