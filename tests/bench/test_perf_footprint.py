"""bench/perf_footprint.py and bench/probe_icache.py on the CPU: how the footprint script
reads ncu's source page into each kernel's executed code, and that the probe's kernels are the code
they claim to be (NVRTC here, no GPU)."""
from __future__ import annotations

import pytest

from bench import perf_footprint as pf

HEADER = '"{a}","Source","Warp Stall Sampling (All Samples)","Instructions Executed","Thread Instructions Executed"\n'


def _table(counts, base=0x7F0000, address="Address"):
    rows = "".join(f'"0x{base + 16 * i:x}","FFMA R1, R2, R3, R4","0","{c}","{32 * int(str(c).replace(",", ""))}"\n'
                   for i, c in enumerate(counts))
    return HEADER.format(a=address) + rows


def test_each_launch_is_a_table_of_its_own():
    text = "Kernel Name: a\n" + _table([8, 8, 0, "1,024"]) + "Kernel Name: b\n" + _table([4, 4], address="# Address")
    tables = pf.sections(text)
    assert [len(t) for t in tables] == [4, 2]
    # 4 instructions; 3 ran; 2 at most once a warp (the entry's count, 8 warps); the loop's 1,024 not
    assert pf.footprint(tables[0]) == (4, 3, 2)
    assert pf.footprint(tables[1]) == (2, 2, 2)
    assert pf.footprint([]) == (0, 0, 0)


def test_the_warp_count_not_the_thread_count():
    rows = pf.sections(_table([8, 0]))[0]
    assert pf.executed_column(rows[0]) == "Instructions Executed"
    with pytest.raises(KeyError):
        pf.executed_column({"Address": "0x0", "Source": "EXIT"})


def test_launch_names_skip_the_units_row():
    raw = ('"ID","Process ID","Kernel Name","gpu__time_duration.sum"\n'
           '"","","","nsecond"\n'
           '"0","7","embedding__bf16__v102400_d2048","1000"\n'
           '"1","7","rms_norm__bf16__d2048","900"\n')
    assert pf.launch_names(raw) == ["embedding__bf16__v102400_d2048", "rms_norm__bf16__d2048"]
    assert pf.launch_names("nothing") == []


def test_a_layer_sums_the_kernels_every_layer_runs(capsys):
    names = ["embedding", "attention", "route", "attention", "route"]
    tables = [pf.sections(_table(c))[0] for c in ([1, 1], [8] * 64, [8] * 32 + [0] * 32, [8] * 64, [8] * 32 + [0] * 32)]
    pf.report(names, tables)
    out = capsys.readouterr().out
    layer = [ln for ln in out.splitlines() if ln.startswith("a MoE layer")][0].split()
    # attention 64 instructions (1.0 KB) all run; route 64 held (1.0 KB), 32 run (0.5 KB)
    assert layer[-3:] == ["2.0", "1.5", "1.5"]
    assert "embedding" in out


def test_the_probe_kernels_are_the_code_they_claim():
    from tests.codegen.sass import cuobjdump, instructions
    if cuobjdump() is None:
        pytest.skip("needs cuobjdump and nvdisasm (the test extra)")
    from bench import probe_icache as pi

    from codegen.nvrtc import compile_cubin
    src = (pi.straight_kernel("s8", 8, 1) + pi.gapped_kernel("g8", 8, 32) + pi.warm_pass_kernel("w8", 8, True)
           + pi.PRIMARY_SRC)
    ins = instructions(compile_cubin(src, "probe", arch="sm_90a", headers={}).cubin)
    ffma = {k: sum(1 for i in v if i.opcode.startswith("FFMA")) for k, v in ins.items()}
    assert ffma["s8"] == 8 * 1024 // 16                   # 8 KB of FFMAs, one SASS instruction each
    assert ffma["g8"] == 2 * 8 * 1024 // 16               # as many again behind the branches
    # a branch over every skipped block, laid out between the executed ones
    assert sum(1 for i in ins["g8"] if i.opcode == "BRA") >= 8 * 1024 // 16 // 32
    # the warm pass runs one copy of its body twice (a rolled loop), the wait inside it
    assert ffma["w8"] == 8 * 1024 // 16
    assert any(i.opcode == "ACQBULK" for i in ins["w8"])
