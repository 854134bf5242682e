"""Hypothesis: mutated Hugging Face DeepSeek-V2/V3 config.json files through `dsgraph spec
--from-config` and `dsgraph compile` (issue 13, item 5: one error hierarchy).

Every mutation of a shipped config (odd, zero, negative, huge, float, string, null values
for the dims; unknown routing / model types; missing keys; broken rope_scaling) must give
either a working spec (it loads, both phases lower and render; on a subset NVRTC compiles
the bundle on the CPU) or a DsgraphError, which the CLI prints as exactly one line
"dsgraph: error: ..." with exit status 2, never a traceback.

The library layer is called directly as well (ir.config_to_spec.spec_from_config,
ir.load_spec, codegen lowering + rendering), so an internal bug cannot pass by being
caught somewhere: whatever these raise must be a DsgraphError subclass.  runtime.cli.main
re-raises anything that is neither a DsgraphError nor a FileNotFoundError; its
user-error branch (`_err`) is watched, and the exception it prints must be a DsgraphError
(the config and spec files here always exist, so a FileNotFoundError would be a bug).

Randomised per run (Hypothesis' default); a failure prints the seed and a reproduction
blob (print_blob), and the @example list beside each test is the fixed regression set.
DSGRAPH_FUZZ_EXAMPLES raises the number of examples for a longer campaign.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import runtime.cli as cli
from codegen.bundle import render_spec
from ir import load_spec
from ir.config_to_spec import spec_from_config
from ir.errors import DsgraphError, SpecError

ROOT = Path(__file__).resolve().parents[2]
BASE_NAMES = ("deepseek_tiny", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")
BASES = {n: json.loads((ROOT / "model_specs" / "hf_configs" / f"{n}.json").read_text()) for n in BASE_NAMES}
EXAMPLES = int(os.environ.get("DSGRAPH_FUZZ_EXAMPLES", "200"))
COMPILE_EXAMPLES = int(os.environ.get("DSGRAPH_FUZZ_COMPILE_EXAMPLES", "3"))
MAX_LAYERS_TO_LOWER = 6     # lowering V3's 61 layers takes seconds; structure repeats after a few
FILE = "fuzz.yaml"
# What codegen's c_float writes for a float32 overflow: not C, so NVRTC would fail on it.
NON_FINITE_LITERAL = re.compile(r"(?<![A-Za-z0-9_.])(inf|nan)\.0f")

# -- what gets mutated -----------------------------------------------------------------

# Values of the wrong kind or out of range, for any key.
GENERIC = [0, -1, -2048, 1.5, 64.0, "64", "", None, True, False, [], {}, [64], 10**12, 2**31, float("nan"),
           float("inf")]

# Per key: values near the edges that a real config might hold.
DIMS = {
    "hidden_size": [1, 2, 3, 7, 127, 129, 4097],
    "num_attention_heads": [1, 2, 3, 5, 128, 129],
    "kv_lora_rank": [1, 2, 31, 33, 512, 513],
    "q_lora_rank": [1, 7, 33, 1536],
    "qk_rope_head_dim": [1, 2, 3, 15, 17, 18, 62, 64, 66, 128],
    "qk_nope_head_dim": [1, 2, 3, 33, 127, 128],
    "v_head_dim": [1, 2, 3, 33, 127, 128, 256],
    "intermediate_size": [1, 2, 3, 77, 10944],
    "moe_intermediate_size": [1, 2, 3, 33, 1407],
    "n_routed_experts": [0, 1, 2, 3, 7, 9, 64, 256, 1024, 1025, 2048],
    "num_experts_per_tok": [0, 1, 2, 3, 7, 8, 9, 257, 2048],
    "n_shared_experts": [0, 1, 2, 3],
    "n_group": [0, 1, 2, 3, 5, 8, 16],
    "topk_group": [0, 1, 2, 3, 4, 9, 17],
    "vocab_size": [1, 2, 3, 1023, 102400, 129280],
    "num_hidden_layers": [0, 1, 2, 3, 4],
    "first_k_dense_replace": [0, 1, 2, 3, 5, 100],
    "moe_layer_freq": [0, 1, 2, 3],
    "max_position_embeddings": [1, 2, 1024, 163840],
    "rms_norm_eps": [1e-6, 1e-12, 1e-320, 0.5, 1e300, -1e-6, 0.0],
    "routed_scaling_factor": [1.0, 2.5, 0.0, -1.0, 16.0, 1e300, 3.4e38, 3.5e38],
    "rope_theta": [1, 1.0, 0.5, 10000, 1e30, 1e300],
}
CHOICES = {
    "model_type": ["deepseek_v2", "deepseek_v3", "llama", "deepseek", "DeepseekV3", None, 3],
    "topk_method": ["greedy", "group_limited_greedy", "noaux_tc", "sparse", None, 1],
    "scoring_func": ["softmax", "sigmoid", "tanh", None, 0],
    "_name_or_path": ["deepseek-ai/DeepSeek-V3", "a b: c", "null", "true", "123", "x\ny", "#", "", None, 7,
                      "{name}", "- item", "\u00e9l\u00e8ve/mod\u00e8le"],
    "tie_word_embeddings": [True, False, "false", 0, 1, None],
    "norm_topk_prob": [True, False, "true", None, 1],
    "rope_interleave": [True, False, "no", None, 0],
}
DELETABLE = sorted(set(DIMS) | set(CHOICES) | {"rope_scaling"})

ROPE_FIELD = {
    "type": st.sampled_from(["yarn", "default", "linear", "dynamic", None, "", 4, ["yarn"]]),
    "rope_type": st.sampled_from(["yarn", "default", "llama3", None]),
    "factor": st.sampled_from([1, 4, 40, 0.5, 0, -1, 1e-300, 1e-40, 1e30, 1e300, 22026.465794806718, "4", None,
                               float("nan")]),
    "original_max_position_embeddings": st.sampled_from([1, 1024, 4096, 0, -1, 1.5, "4096", None, 10**20]),
    "beta_fast": st.sampled_from([32, 1, 0, -1, 1e-300, 1e300, "32", None]),
    "beta_slow": st.sampled_from([1, 32, 0, -1, "1", None]),
    "mscale": st.sampled_from([0.707, 1, 0, -1, -10, 3e38, 1e300, "1", None]),
    "mscale_all_dim": st.sampled_from([0.707, 1, 0, -1, -1e3, 1e-300, 3e38, "x", None]),
    "truncate": st.sampled_from([True, False, "no", 1, None]),
    "rope_theta": st.sampled_from([10000, 1, 0, "1e4", None]),
}
ROPE = st.one_of(
    st.sampled_from([None, "yarn", [], 4, {}, {"type": "yarn"}, {"type": "linear", "factor": 2.0},
                     {"type": "yarn", "original_max_position_embeddings": 0}]),
    st.fixed_dictionaries({"type": st.just("yarn"), "original_max_position_embeddings": st.just(4096)},
                          optional={k: v for k, v in ROPE_FIELD.items()
                                    if k not in ("type", "original_max_position_embeddings")}),
    st.fixed_dictionaries({}, optional=ROPE_FIELD),
)


@st.composite
def mutation(draw):
    kind = draw(st.sampled_from(["dim", "dim", "dim", "generic", "choice", "delete", "rope"]))
    if kind == "dim":
        key = draw(st.sampled_from(sorted(DIMS)))
        return ("set", key, draw(st.sampled_from(DIMS[key])))
    if kind == "generic":
        key = draw(st.sampled_from(sorted(set(DIMS) | set(CHOICES))))
        return ("set", key, draw(st.sampled_from(GENERIC)))
    if kind == "choice":
        key = draw(st.sampled_from(sorted(CHOICES)))
        return ("set", key, draw(st.sampled_from(CHOICES[key])))
    if kind == "delete":
        return ("delete", draw(st.sampled_from(DELETABLE)))
    return ("set", "rope_scaling", draw(ROPE))


def make_config(base: str, mutations) -> dict:
    cfg = copy.deepcopy(BASES[base])
    if base != "deepseek_tiny":
        # Keep the big models' structure (dense layers, then MoE) but only a few layers, so
        # lowering stays fast; a mutation may still set num_hidden_layers.
        cfg["num_hidden_layers"] = min(cfg["num_hidden_layers"], (cfg.get("first_k_dense_replace") or 0) + 2)
    for m in mutations:
        if m[0] == "delete":
            cfg.pop(m[1], None)
        else:
            cfg[m[1]] = m[2]
    return cfg


# -- the checks ------------------------------------------------------------------------

def _one_line_error(rc: int, err: str) -> None:
    assert rc == cli.EXIT_USER_ERROR, (rc, err)
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsgraph: error: "), err


class CLI:
    """runtime.cli.main in-process, with its user-error branch watched: `printed` is the
    exception main() turned into a "dsgraph: error:" line (sys.exc_info() inside _err)."""

    def __init__(self, monkeypatch, capsys):
        self.capsys, self.printed = capsys, []
        original = cli._err

        def watched(message):
            self.printed.append(sys.exc_info()[1])
            return original(message)

        monkeypatch.setattr(cli, "_err", watched)

    def __call__(self, *argv):
        self.capsys.readouterr()
        self.printed.clear()
        rc = cli.main(list(argv))
        out = self.capsys.readouterr()
        for exc in self.printed:
            assert isinstance(exc, DsgraphError), f"main() printed a {type(exc).__name__} as a user error: {exc!r}"
        return rc, out.out, out.err


def _library(fn, *args, **kwargs):
    """(result, None) or (None, the DsgraphError it raised); any other exception fails the test."""
    try:
        return fn(*args, **kwargs), None
    except DsgraphError as e:
        assert "\n" not in str(e), f"{type(e).__name__} is not one line: {e}"
        return None, e
    except Exception as e:  # noqa: BLE001 - this is the check
        raise AssertionError(f"{fn.__module__}.{fn.__name__} raised {type(e).__name__}, not a DsgraphError: "
                             f"{e!r}") from e


def check_config(cfg: dict, run, workdir: Path, *, compile_ok: bool) -> str:
    """Run one config through the library and the CLI; returns what happened (for notes)."""
    cfg_path, spec_path = workdir / "config.json", workdir / "spec.yaml"
    cfg_path.write_text(json.dumps(cfg))

    text, err = _library(spec_from_config, cfg)
    if err is not None:
        assert isinstance(err, SpecError) and err.file == "config.json", repr(err)
        assert err.path, f"the error names no config key: {err}"
    rc, _, stderr = run("spec", "--from-config", str(cfg_path), "-o", str(spec_path))
    if err is not None:
        _one_line_error(rc, stderr)
        assert str(cfg_path) in stderr and err.path in stderr, stderr
        return "config refused"
    assert rc == 0, stderr
    assert spec_path.read_text() == text

    spec, err = _library(load_spec, text, file=FILE)
    lowered = False
    if err is None and spec.dims["layers"] <= MAX_LAYERS_TO_LOWER:
        rendered, err = _library(render_spec, spec, strict=True)
        lowered = err is None
        for k in rendered[1] if lowered else ():
            bad = NON_FINITE_LITERAL.search(k.source)
            assert bad is None, f"kernel {k.name} bakes a non-finite constant {bad.group(0)!r}"
    if err is not None:
        # A spec that does not load or lower fails `dsgraph compile` before NVRTC runs: cheap.
        rc, _, stderr = run("compile", str(spec_path), "-o", str(workdir / "bundle"),
                            "--cache-dir", str(workdir / "cache"))
        _one_line_error(rc, stderr)
        return "spec refused"
    if compile_ok and lowered:
        rc, out, stderr = run("compile", str(spec_path), "-o", str(workdir / "bundle"),
                              "--cache-dir", str(workdir / "cache"))
        assert rc == 0, stderr
        assert (workdir / "bundle" / "manifest.json").is_file(), out
        return "compiled"
    return "lowered" if lowered else "loaded"


FUZZ = settings(max_examples=EXAMPLES, deadline=None, print_blob=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# -- 1. every mutation: library + `dsgraph spec` + (when it fails) `dsgraph compile` --------

@FUZZ
@given(base=st.sampled_from(BASE_NAMES), mutations=st.lists(mutation(), min_size=1, max_size=3))
# regressions: each of these raised a non-DsgraphError (or wrote a spec that is not YAML) before
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling", "yarn")])                 # AttributeError
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling", [1])])                    # AttributeError
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling",
                                           {"type": "yarn", "original_max_position_embeddings": 0})])  # ZeroDivision
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling",
                                           {"type": "yarn", "original_max_position_embeddings": "x"})])  # TypeError
@example(base="deepseek_tiny", mutations=[("set", "rms_norm_eps", None)])                   # TypeError in _num
@example(base="deepseek_tiny", mutations=[("set", "routed_scaling_factor", "x")])           # ValueError in _num
@example(base="deepseek_tiny", mutations=[("set", "_name_or_path", None)])                  # AttributeError
@example(base="deepseek_tiny", mutations=[("set", "_name_or_path", "a b: c")])              # invalid YAML written
@example(base="deepseek_tiny", mutations=[("set", "_name_or_path", "x\ny")])                # header comment broken
@example(base="deepseek_tiny", mutations=[("set", "_name_or_path", "null")])                # name read back as None
@example(base="deepseek_tiny", mutations=[("set", "hidden_size", "128")])                   # a string dim accepted
@example(base="deepseek_tiny", mutations=[("set", "moe_layer_freq", 0)])                    # 0 silently became 1
@example(base="deepseek_tiny", mutations=[("set", "tie_word_embeddings", "false")])         # "false" read as true
@example(base="deepseek_tiny", mutations=[("set", "rope_theta", 1)])                        # ZeroDivision in rope
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling",
                                           {"type": "yarn", "original_max_position_embeddings": 1,
                                            "factor": 1e-300})])                           # ZeroDivision in rope
@example(base="deepseek_tiny", mutations=[("set", "routed_scaling_factor", 1e300)])         # "inf.0f" constant
@example(base="deepseek_tiny", mutations=[("set", "rms_norm_eps", 1e300)])                  # "inf.0f" norm eps
@example(base="deepseek_tiny", mutations=[("set", "num_hidden_layers", 10**12)])            # graph build hangs
@example(base="deepseek_tiny", mutations=[("set", "n_routed_experts", 10**12)])             # 10^12 weight names
@example(base="deepseek_tiny", mutations=[("set", "n_shared_experts", 2**31)])             # 2^31 shared slices: OOM
@example(base="deepseek_tiny", mutations=[("set", "n_shared_experts", 9)])                  # more than the route serves
@example(base="deepseek_tiny", mutations=[("set", "qk_rope_head_dim", 10**12)])             # "...# R" dim string
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling",
                                           {"type": "yarn", "original_max_position_embeddings": 1024, "factor": 1e30,
                                            "mscale": 1, "mscale_all_dim": 3e38})])        # "inf.0f" softmax scale
@example(base="deepseek_tiny", mutations=[("set", "rope_scaling",
                                           {"type": "yarn", "original_max_position_embeddings": 1024,
                                            "factor": 22026.465794806718, "mscale": 1,
                                            "mscale_all_dim": -1})])                       # ZeroDivision: mscale 0
# the edges named in the issue
@pytest.mark.slow
@example(base="deepseek_tiny", mutations=[("set", "n_routed_experts", 2048)])
@example(base="deepseek_tiny", mutations=[("set", "n_routed_experts", 1025)])
@example(base="deepseek_v3", mutations=[("set", "n_routed_experts", 2048)])
@example(base="deepseek_tiny", mutations=[("set", "n_routed_experts", 0)])
@example(base="deepseek_tiny", mutations=[("set", "n_routed_experts", 7)])
@example(base="deepseek_tiny", mutations=[("set", "qk_rope_head_dim", 15)])
@example(base="deepseek_v3", mutations=[("set", "qk_rope_head_dim", 63)])
@example(base="deepseek_tiny", mutations=[("set", "num_experts_per_tok", 9)])
@example(base="deepseek_v3", mutations=[("set", "n_group", 7)])
@example(base="deepseek_v3", mutations=[("set", "topk_group", 9)])
@example(base="deepseek_v2_lite", mutations=[("set", "topk_method", "group_limited_greedy"),
                                              ("set", "n_group", 4), ("set", "topk_group", 5)])
@example(base="deepseek_tiny", mutations=[("set", "first_k_dense_replace", 100)])
@example(base="deepseek_tiny", mutations=[("set", "num_hidden_layers", 0)])
@example(base="deepseek_tiny", mutations=[("set", "scoring_func", "sigmoid")])
@example(base="deepseek_tiny", mutations=[("set", "model_type", "llama")])
@example(base="deepseek_tiny", mutations=[("delete", "hidden_size")])
@example(base="deepseek_tiny", mutations=[("set", "hidden_size", float("nan"))])
@example(base="deepseek_tiny", mutations=[("set", "vocab_size", 10**12)])
def test_mutated_config_is_a_spec_or_one_line_error(base, mutations, monkeypatch, capsys):
    run = CLI(monkeypatch, capsys)
    with tempfile.TemporaryDirectory() as tmp:
        event(check_config(make_config(base, mutations), run, Path(tmp), compile_ok=False))


# -- 2. a subset through NVRTC: `dsgraph compile` must build what the library lowers ------

# Mutations of deepseek_tiny whose spec should lower and compile (kept small: ~2 s of NVRTC each).
COMPILE_DIMS = {
    "hidden_size": [127, 129, 257],
    "num_attention_heads": [1, 3, 5],
    "kv_lora_rank": [31, 33, 64],
    "q_lora_rank": [7, 33],
    "qk_rope_head_dim": [2, 18, 30],
    "qk_nope_head_dim": [1, 33],
    "v_head_dim": [1, 33],
    "intermediate_size": [1, 77],
    "moe_intermediate_size": [1, 33],
    "n_routed_experts": [2, 7, 9, 1024],
    "num_experts_per_tok": [1, 2],
    "vocab_size": [1, 1023],
    "first_k_dense_replace": [0, 2],
}


@st.composite
def compile_mutation(draw):
    key = draw(st.sampled_from(sorted(COMPILE_DIMS)))
    return ("set", key, draw(st.sampled_from(COMPILE_DIMS[key])))


@pytest.mark.slow
@settings(FUZZ, max_examples=COMPILE_EXAMPLES)
@given(mutations=st.lists(compile_mutation(), min_size=1, max_size=3))
@example(mutations=[("set", "hidden_size", 127), ("set", "kv_lora_rank", 31), ("set", "qk_nope_head_dim", 33),
                    ("set", "v_head_dim", 33), ("set", "moe_intermediate_size", 33), ("set", "intermediate_size", 77)])
@example(mutations=[("set", "n_routed_experts", 7), ("set", "num_experts_per_tok", 7), ("set", "qk_rope_head_dim", 18)])
@example(mutations=[("set", "n_routed_experts", 1024), ("set", "num_experts_per_tok", 1)])
@example(mutations=[("set", "n_routed_experts", 2048)])                 # refused before NVRTC (> 1024 experts)
@example(mutations=[("set", "num_experts_per_tok", 9)])                 # refused: top-k > experts
def test_compile_on_cpu_succeeds_or_is_one_line_error(mutations, monkeypatch, capsys):
    run = CLI(monkeypatch, capsys)
    with tempfile.TemporaryDirectory() as tmp:
        event(check_config(make_config("deepseek_tiny", mutations), run, Path(tmp), compile_ok=True))


# -- 3. a few fixed shapes of broken input ---------------------------------------------

@pytest.mark.parametrize("content, message", [
    ("[1, 2, 3]", "a config.json is a JSON object"),
    ("null", "a config.json is a JSON object"),
    ('{"model_type": "deepseek_v2",\n oops}', "not valid JSON"),
    ("", "is empty"),                  # said as such, not as a JSON error at line 1
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_config_file_that_is_not_a_config(tmp_path, monkeypatch, capsys, content, message):
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    rc, _, err = CLI(monkeypatch, capsys)("spec", "--from-config", str(path))
    _one_line_error(rc, err)
    assert message in err, err


def test_missing_config_and_unwritable_output_are_one_line_errors(tmp_path, monkeypatch, capsys):
    run = CLI(monkeypatch, capsys)
    tiny = str(ROOT / "model_specs" / "hf_configs" / "deepseek_tiny.json")
    for argv, message in [
        (["spec", "--from-config", str(tmp_path / "missing.json")], "config file not found"),
        (["spec", "--from-config", str(tmp_path)], "is a folder; give its config.json"),
        (["spec", "--from-config", tiny, "-o", str(tmp_path)], "cannot write"),
        (["spec", "--from-config", tiny, "-o", str(tmp_path / "no" / "such" / "spec.yaml")], "cannot write"),
    ]:
        rc, _, err = run(*argv)
        _one_line_error(rc, err)
        assert message in err, err


def test_the_watch_sees_a_non_dsgraph_error(monkeypatch, capsys):
    """The CLI wrapper above would notice main() printing a bug as a user error."""
    run = CLI(monkeypatch, capsys)

    def buggy(args):
        raise FileNotFoundError("an internal bug that happens to be a FileNotFoundError")

    monkeypatch.setitem(cli.COMMANDS, "spec", (cli.add_spec_args, buggy))
    with pytest.raises(AssertionError, match="printed a FileNotFoundError"):
        run("spec", "--from-config", "x.json")
