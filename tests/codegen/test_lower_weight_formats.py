"""codegen/lower.py: a node whose weight is stored in a format its family's kernels do not take fails in one
line at lowering (the reference backend runs it)."""
import json
from pathlib import Path

import pytest

import ir
from codegen import families
from codegen.errors import LoweringError
from codegen.kernel import Options
from codegen.lower import lower_graph, weight_format_problem
from ir.config_to_spec import spec_from_config
from ir.passes import run_pipeline

ROOT = Path(__file__).resolve().parents[2]
TINY = json.loads((ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json").read_text())
O_PROJ = "model.layers.1.self_attn.o_proj.weight"


def _graph(formats: str):
    spec = ir.load_spec(spec_from_config(TINY, name="tiny") + "\nweight_formats:\n" + formats, file="t.yaml")
    return run_pipeline(ir.build_graph(spec, "decode"))


def test_an_fp8_weight_without_an_fp8_kernel_is_one_line():
    G = _graph(f'  "{O_PROJ}": fp8_e4m3_block128\n')
    (nid,) = [n for n, d in G.nodes(data=True) if O_PROJ in d["weights"].values()]
    op = G.nodes[nid]["op"]
    takes = getattr(families.family_for_op(op), "WEIGHT_FORMATS", ())
    if "fp8_e4m3_block128" in takes:
        pytest.skip(f"{op}'s family has an FP8 kernel")
    with pytest.raises(LoweringError) as info:
        lower_graph(G, Options())
    message = str(info.value)
    assert "\n" not in message
    assert (f"no kernel for weight format fp8_e4m3_block128 at {op} {nid} on the cuda backend; "
            f"run it with backend='reference'") in message
    assert message.startswith("t.yaml:")
    plan = lower_graph(G, Options(), strict=False)
    assert (nid, op) in plan.unlowered


def test_unscaled_weights_pass_the_format_check():
    G = _graph('  "model.layers.1.self_attn.o_proj.weight": act\n')
    assert not any(weight_format_problem(G, n, families.family_for_op(d["op"]), Options())
                   for n, d in G.nodes(data=True))


@pytest.mark.parametrize("quant", [{"quantize": "w8a8_dynamic", "moe_quantize": "w4a8_dynamic"},
                                   {"quantize": "w8a8_dynamic"}])
def test_msmodelslim_integer_weights_lower_on_the_cuda_backend(quant):
    """spec --from-config reads msModelSlim's quantize / moe_quantize; the cuda backend lowers the int8 linears
    and the int4 / int8 routed experts (their kernels: tests/codegen/test_linear_int8.py,
    tests/codegen/test_moe_int_lowering.py)."""
    text = spec_from_config({**TINY, **quant}, name="tiny")
    assert '"model.layers.*.self_attn.kv_b_proj.weight": act' in text
    assert '"model.layers.*.mlp.experts.*": ' + ("int4_channel" if "moe_quantize" in quant else "int8_channel") in text
    G = run_pipeline(ir.build_graph(ir.load_spec(text, file="t.yaml"), "decode"))
    assert lower_graph(G, Options()).steps
