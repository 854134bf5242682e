"""The kernel-family registry: every module in this folder is one family.

A family module exposes (see codegen/kernel.py for the contract)

    FAMILY: str                 e.g. "rms_norm"
    TEMPLATE: str               e.g. "rms_norm.cu.j2"
    OPS: tuple[str, ...]        graph ops it implements
    def lower(nid, G, opts) -> list[KernelLaunch]
    PDL: bool                   optional (default False): its kernels keep templates/include/pdl.cuh's
                                contract, so they are launched with programmatic dependent launch

Discovery is by module name, sorted, so the registry (and everything derived
from it: kernel order, bundle manifests, goldens) is deterministic.  Two
families claiming the same op is a bug the registry refuses to paper over.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from types import ModuleType

_REQUIRED = ("FAMILY", "TEMPLATE", "OPS", "lower")


class RegistryError(RuntimeError):
    """A family module breaks the registry contract (missing attribute, duplicate op claim)."""


def _check(module: ModuleType) -> None:
    missing = [a for a in _REQUIRED if not hasattr(module, a)]
    if missing:
        raise RegistryError(f"kernel family module {module.__name__} lacks {', '.join(missing)} "
                            f"(a family exposes FAMILY, TEMPLATE, OPS and lower(nid, G, opts))")
    if not callable(module.lower):
        raise RegistryError(f"{module.__name__}.lower is not callable")
    ops = module.OPS
    if isinstance(ops, str) or not all(isinstance(o, str) for o in ops):
        raise RegistryError(f"{module.__name__}.OPS must be a tuple of op names, got {ops!r}")
    if not isinstance(getattr(module, "PDL", False), bool):
        raise RegistryError(f"{module.__name__}.PDL must be True or False, got {module.PDL!r}")


def index(modules) -> dict[str, ModuleType]:
    """op -> family module, refusing an op claimed twice."""
    by_op: dict[str, ModuleType] = {}
    for module in modules:
        _check(module)
        for op in module.OPS:
            other = by_op.get(op)
            if other is not None:
                raise RegistryError(f"op {op!r} is claimed by two kernel families: "
                                    f"{other.__name__} and {module.__name__}")
            by_op[op] = module
    return by_op


@functools.lru_cache(maxsize=1)
def _registry() -> tuple[tuple[ModuleType, ...], dict[str, ModuleType], dict[str, ModuleType]]:
    # Modules named _* are helpers shared by families, not families.
    modules = tuple(importlib.import_module(f"{__name__}.{info.name}")
                    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name)
                    if not info.name.startswith("_"))
    return modules, index(modules), {m.FAMILY: m for m in modules}


def families() -> tuple[ModuleType, ...]:
    """Every family module, sorted by module name."""
    return _registry()[0]


def family_for_op(op: str) -> ModuleType | None:
    """The family module that implements graph op `op`, or None if no family claims it."""
    return _registry()[1].get(op)


def family_named(name: str) -> ModuleType | None:
    """The family module whose FAMILY is `name` (a KernelLaunch's family), or None."""
    return _registry()[2].get(name)


def claimed_ops() -> dict[str, str]:
    """op -> family name, for every op some family implements."""
    return {op: m.FAMILY for op, m in sorted(_registry()[1].items())}


def uses_pdl(module: ModuleType) -> bool:
    """Whether a family's kernels keep the PDL contract (its PDL attribute; False when absent)."""
    return getattr(module, "PDL", False)


def reload() -> None:
    """Forget the discovered families (tests that add a family module on the fly)."""
    _registry.cache_clear()
