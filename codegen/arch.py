"""Target architectures: which device runs a bundle's CUBINs, which arch-specific features its
kernels may use, what NVRTC target each kernel is built for, and which target the runtime picks
for a device.

An arch is NVRTC's name, "sm_<major><minor>" with an optional "a".  "sm_90a" is sm_90 plus the
architecture-specific instructions of compute capability 9.0 exactly (wgmma, setmaxnreg); its CUBINs
run on 9.0 devices only.  A bundle is built for one target (Options.arch, "sm_90" by default) and
runs on devices of that compute capability.  A kernel that uses arch-specific instructions says so
in ``KernelLaunch.requires`` (the feature is the arch-specific target's own name, "sm_90a"): a
bundle whose target has that compute capability may hold it, and that one kernel is built for the
arch-specific target (``kernel_target``), the others for the bundle's.  The manifest records each
kernel's features and their union; loading a bundle on a device of another compute capability is
one error that names them.

One set of defaults: ``dsgraph compile`` targets ``DEFAULTS.arch`` (codegen/kernel.py), and the
runtime compiles for ``target_arch(its device)``: that same default on a device of its compute
capability (the same bundle under the same cache key), the device's plain arch elsewhere.
"""
from __future__ import annotations

from .nvrtc import ArchError, parse_arch

# What dsgraph's kernels are written for (wgmma, TMA, programmatic dependent launch): one wording
# for the compile command and the runtime's device check.
SUPPORTED_GPUS = "Hopper GPUs (compute capability 9.0: H100, H200)"
MIN_ARCH = 90


def check_supported(target: str) -> None:
    """ArchError, in one line that says what is supported, for a target older than Hopper."""
    if parse_arch(target) < MIN_ARCH:
        raise ArchError(f"dsgraph's kernels are written for {SUPPORTED_GPUS}; {target} is older: "
                        f"compile for sm_90 or sm_90a")


def features(target: str) -> frozenset:
    """The arch-specific features kernels of a bundle for `target` may require: its compute
    capability's "a" target (sm_90 and sm_90a both offer "sm_90a")."""
    return frozenset({f"sm_{parse_arch(target)}a"})


def has_feature(target: str, feature: str) -> bool:
    return feature in features(target)


def kernel_target(target: str, requires=()) -> str:
    """The NVRTC target of one kernel of a bundle for `target`: the arch-specific feature it
    requires (at most one), else the bundle's target."""
    req = sorted(set(requires))
    if len(req) > 1:
        raise ValueError(f"a kernel requires at most one arch-specific target, got {req}")
    return req[0] if req else target


def runs_on(target: str, device: str) -> bool:
    """Whether CUBINs built for `target` (or its "a" form) load on a device of arch `device`
    ("sm_90" for 9.0): the same compute capability (dsgraph builds for the device it runs on)."""
    return parse_arch(target) == parse_arch(device)


def target_arch(device: str, default: str | None = None) -> str:
    """What the runtime compiles for on a device of arch `device`: the default target (DEFAULTS.arch)
    where the device runs it, else the device's own plain arch."""
    if default is None:
        from .kernel import DEFAULTS
        default = DEFAULTS.arch
    return default if runs_on(default, device) else device
