"""bench/perf_phases.py, the in-kernel phase marks of a decode step, on the CPU: how it turns
mark tables into a chain of the last layer's kernels and its per-boundary figures."""
from __future__ import annotations

import os

from bench import perf_phases as pp

US = 1000   # ns


def _row(called, waited, exit_, trigger=None, own=None, clk0=10_000, entered=None):
    """One CTA's (ns, clk) marks; the cycle counter runs at 2 cycles an ns from clk0."""
    ns = [0] * pp.MARKS
    ns[pp.WAIT_CALL], ns[pp.WAITED], ns[pp.EXIT] = called, waited, exit_
    ns[pp.TRIGGER] = trigger or waited
    if entered:
        ns[pp.ENTRY] = entered
    for k, v in (own or {}).items():
        ns[k] = v
    clk = [clk0 + 2 * (v - called) if v else 0 for v in ns]
    return ns, clk


def _sample():
    return {
        # an earlier layer's kernel, and the step's lm_head after the layer: outside the window
        "linear_skinny__bf16__k10944__o2048": [_row(1 * US, 2 * US, 5 * US)],
        "linear_skinny__bf16__k2048__o102400": [_row(1030 * US, 1100 * US, 1200 * US)],
        "mla_decode_attention__bf16__c512_r64__h16__page64__s8": [_row(985 * US, 990 * US, 994 * US, entered=983 * US),
                                                                  _row(986 * US, 990 * US, 993 * US, entered=984 * US)],
        "mla_decode_query__bf16__h16": [_row(979 * US, 980 * US, 982 * US)],
        "fused_add_rms_norm__bf16__d2048": [_row(995 * US, 1000 * US, 1002 * US)],
        "moe_route__bf16__d2048__e64_k6__fused_t256": [
            _row(999 * US, 1003 * US, 1004 * US, own={4: 1003_500}),
            _row(1000 * US, 1004 * US, 1009 * US, own={4: 1004_500, 5: 1006 * US, 6: 1007 * US})],
        "moe_gate_up_silu__bf16__e66__wgmma_skinny": [_row(1001 * US, 1010 * US, 1030 * US, own={4: 1011 * US})],
    }


def test_the_chain_is_the_last_layer_in_the_order_of_its_waits():
    names = [n for n, _ in pp.chain(_sample(), (15.0, 80.0))]
    assert names == ["mla_decode_query__bf16__h16", "mla_decode_attention__bf16__c512_r64__h16__page64__s8",
                     "fused_add_rms_norm__bf16__d2048",
                     "moe_route__bf16__d2048__e64_k6__fused_t256", "moe_gate_up_silu__bf16__e66__wgmma_skinny"]
    # without an attention among the marks: the window before the step's last exit
    rest = {n: r for n, r in _sample().items() if not n.startswith(("mla_", "linear_skinny__bf16__k2048"))}
    assert [n for n, _ in pp.chain(rest, (15.0, 80.0))][0] == "fused_add_rms_norm__bf16__d2048"


def test_a_kernel_is_its_first_wait_return_and_its_last_exit():
    # a row an earlier, larger launch of the step left is not the last launch's
    stale = _row(930 * US, 931 * US, 933 * US)
    s = pp.summarise(_sample()["moe_route__bf16__d2048__e64_k6__fused_t256"] + [stale])
    assert (s["ctas"], s["called"], s["first"], s["last"], s["exit"]) == (2, 999 * US, 1003 * US, 1004 * US, 1009 * US)
    assert s["own"][4] == (1003_500, 1004_500) and s["own"][6] == (1007 * US, 1007 * US)
    # the cycle view is the CTA that exits last: 2 cycles an ns from its wait return
    assert s["cycles"][pp.EXIT] == 2 * (1009 - 1004) * US


def test_the_report_gives_each_boundary_against_the_previous_exit(capsys):
    pp.report([_sample(), _sample()], (15.0, 80.0), ghz=2.0)
    out = capsys.readouterr().out.splitlines()
    table = [line for line in out if ":" not in line]
    route = next(line for line in table if line.strip().startswith("moe_route"))
    # no entry mark; called 999 - 1002 = -3, waited 1003 - 1002 = 1, spread 1, work 6, adds 7 (us)
    assert route.split()[-7:] == ["2", "-", "-3.00", "1.00", "1.00", "6.00", "7.00"]
    gate = next(line for line in table if line.strip().startswith("moe_gate_up_silu"))
    assert gate.split()[-7:] == ["1", "-", "-8.00", "1.00", "0.00", "20.00", "21.00"]
    # the attention marks its entry: its first CTA's 983 after the query's exit at 982
    att = next(line for line in table if line.strip().startswith("mla_decode_attention"))
    assert att.split()[-7:] == ["2", "1.00", "3.00", "8.00", "0.00", "4.00", "12.00"]
    marks = next(line for line in out if line.strip().startswith("moe_route") and ":" in line)
    assert "logits issued 1.50 (0.50)" in marks and "top-k done 4.00" in marks
    # the route's last CTA exits 5 us after its wait return: 10000 cycles at 2 GHz
    assert "exit 5.00" in marks.split("clock:")[1]


def test_the_script_compiles_every_kernel_with_the_marks_into_a_cache_of_its_own(monkeypatch):
    import codegen.nvrtc as nvrtc
    monkeypatch.setattr(nvrtc, "compile_cubin", nvrtc.compile_cubin)   # restored after the test
    monkeypatch.setenv("DSGRAPH_CACHE_DIR", "/elsewhere")
    pp.with_phase_marks()
    assert os.environ["DSGRAPH_CACHE_DIR"] != "/elsewhere" and os.path.isdir(os.environ["DSGRAPH_CACHE_DIR"])
    golden = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "codegen", "golden", "deepseek_v2_lite")
    name = "fused_add_rms_norm__bf16__d2048"
    cubin = nvrtc.compile_cubin(open(os.path.join(golden, name + ".cu")).read(), name, arch="sm_90").cubin
    assert b"dsg_phase_ns" in cubin and b"dsg_phase_clk" in cubin
