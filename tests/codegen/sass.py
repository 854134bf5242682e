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
from typing import NamedTuple

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


def _sass(cubin: bytes) -> str:
    """`cuobjdump -sass` of a cubin."""
    tools = _tools()
    assert tools, "cuobjdump / nvdisasm not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)"
    exe, dis = tools
    env = {**os.environ, "PATH": os.path.dirname(dis) + os.pathsep + os.environ.get("PATH", "")}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        return subprocess.run([exe, "-sass", fh.name], capture_output=True, text=True, env=env, check=True).stdout


def opcodes(cubin: bytes) -> collections.Counter:
    """Opcode (with modifiers, e.g. HMMA.16816.F32.BF16) -> count, from `cuobjdump -sass`."""
    return collections.Counter(m.group(1) for m in _OPCODE.finditer(_sass(cubin)))


class Instr(NamedTuple):
    addr: int          # byte offset in the function
    opcode: str        # with modifiers, e.g. LDG.E.128
    operands: str      # the rest up to ';' (predicate guard not included)
    guarded: bool = False   # under a predicate guard (@P0 / @!P1 ...): may not execute


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)([^;]*);")
_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$", re.M)


def instructions(cubin: bytes) -> dict[str, list[Instr]]:
    """Function name -> its instructions in address order, from `cuobjdump -sass`."""
    out = _sass(cubin)
    heads = list(_FUNCTION.finditer(out))
    funcs = {}
    for i, m in enumerate(heads):
        body = out[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(out)]
        funcs[m.group(1)] = [Instr(int(x.group(1), 16), x.group(3), x.group(4).strip(), x.group(2) is not None)
                             for x in _INSTR.finditer(body)]
    return funcs
