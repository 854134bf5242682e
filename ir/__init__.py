"""dsgraph's front end: spec -> graph -> passes, with reference semantics for every op.

The names below load on first use (PEP 562), so `import ir.errors` or `import ir.spec`
does not pull in the graph machinery (networkx): loading a bundle to run it never does.
"""
_LAZY = {
    "GraphError": ".errors", "SpecError": ".errors", "DsgraphError": ".errors",
    "PHASES": ".graph", "build_graph": ".graph", "topo_order": ".graph",
    "run_graph": ".interpret",
    "Spec": ".spec", "load_spec": ".spec", "parse_spec": ".spec",
    "verify": ".verifier",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
