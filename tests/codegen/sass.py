"""The machine code NVRTC produced for a kernel, for tests that check the instructions a kernel
was written to use (a silent fall-back to a slower path then fails on the CPU).

cuobjdump and nvdisasm come from the `nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels
(the `test` extra); cuda.pathfinder finds them.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

# Modifiers may hold lower case (HGMMA.64x256x16.F32.BF16).
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")


def _tools() -> tuple[str, str] | None:
    """(cuobjdump, nvdisasm) paths, or None where either is missing."""
    try:
        from cuda.pathfinder import find_nvidia_binary_utility
    except ImportError:
        return None
    exe, dis = find_nvidia_binary_utility("cuobjdump"), find_nvidia_binary_utility("nvdisasm")
    return (exe, dis) if exe and dis else None


def cuobjdump() -> str | None:
    """The cuobjdump binary, with nvdisasm beside it, or None."""
    tools = _tools()
    return tools[0] if tools else None


def opcodes(cubin: bytes) -> collections.Counter:
    """Opcode (with modifiers, e.g. HMMA.16816.F32.BF16) -> count, from `cuobjdump -sass`."""
    tools = _tools()
    assert tools, "cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
    exe, dis = tools
    env = {**os.environ, "PATH": os.path.dirname(dis) + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        out = subprocess.run([exe, "-sass", fh.name], capture_output=True, text=True, env=env, check=True).stdout
    return collections.Counter(m.group(1) for m in _OPCODE.finditer(out))
