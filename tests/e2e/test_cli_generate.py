"""`dsgraph generate` on the reference backend: a saved checkpoint gives transformers' greedy
tokens; a spec runs with random weights; bad input exits 2 with one message."""
from __future__ import annotations

import pytest

from hf_tiny import build, hf_generate, load_reference
from runtime.cli import main


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    return build("v3", tmp_path_factory.mktemp("v3"))


def _ids(out: str) -> list[int]:
    line = next(l for l in out.splitlines() if l.startswith("ids:"))
    return [int(x) for x in line.split(":", 1)[1].strip().split(",")]


def test_generate_from_checkpoint_matches_transformers(v3_dir, capsys):
    prompt = [5, 17, 3, 44]
    assert main(["generate", "--model", str(v3_dir), "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "6",
                 "--backend", "reference", "--device", "cpu", "--dtype", "fp32"]) == 0
    ours = _ids(capsys.readouterr().out)
    ref, _ = hf_generate(load_reference(v3_dir), prompt, 6)
    assert ours == ref


def test_generate_random_weights_from_a_spec(tmp_path, capsys):
    from hf_tiny import v2_lite_config
    from ir.config_to_spec import spec_from_config
    spec = tmp_path / "tiny.yaml"
    spec.write_text(spec_from_config(v2_lite_config().to_dict(), name="tiny"))
    args = ["generate", "--random-weights", "--spec", str(spec), "--ids", "1,2,3", "--max-new-tokens", "4",
            "--backend", "reference", "--device", "cpu"]
    assert main(args) == 0
    first = _ids(capsys.readouterr().out)
    assert main(args) == 0
    assert _ids(capsys.readouterr().out) == first and len(first) == 4


@pytest.mark.parametrize("extra, message", [
    (["--ids", "1,2,x"], "comma-separated integers"),
    (["--ids", "1,2,100000"], "out of range"),
    (["--prompt", "hello"], "needs a tokenizer"),
])
def test_generate_bad_input_exits_2(v3_dir, capsys, extra, message):
    rc = main(["generate", "--model", str(v3_dir), "--backend", "reference", "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
