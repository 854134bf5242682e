"""`dsgraph generate` under torchrun (2 gloo processes on the CPU): every rank runs its part,
rank 0 alone prints, and the tokens are the single-process run's; random weights give the same
model however it is spread (each rank draws whole tensors by name and keeps its slice)."""
from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
import torch.multiprocessing as mp

from test_parallel import _free_port, _launch_env   # what torchrun sets, loopback only

from codegen.paths import MODEL_SPECS_DIR

TINY = str(MODEL_SPECS_DIR / "deepseek_tiny.yaml")     # 4 heads, 8 experts: splits over 2 ranks
ARGS = ["generate", "--random-weights", "--spec", TINY, "--ids", "5,17,3,99", "--max-new-tokens", "6",
        "--ignore-eos", "--backend", "reference", "--device", "cpu"]


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    _launch_env(rank, world, port)
    torch.set_num_threads(1)
    from runtime.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(ARGS)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"rc={rc}\n{out.getvalue()}")


@pytest.mark.slow
def test_generate_under_torchrun_prints_once_and_matches_one_process(tmp_path, capsys):
    from runtime.cli import main
    assert main(ARGS) == 0
    alone = capsys.readouterr().out
    mp.start_processes(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert rank0.startswith("rc=0\n") and rank1 == "rc=0\n"
    ids = [line for line in rank0.splitlines() if line.startswith("ids:")]
    assert ids == [line for line in alone.splitlines() if line.startswith("ids:")] and len(ids[0].split(",")) == 6


def test_random_weights_are_one_model_however_spread():
    """A rank draws its slices and experts of the very tensors one process draws whole (one process
    binds the shared MLP in the expert stacks, a rank does not: compared checkpoint tensor by tensor)."""
    from runtime.model_loader import bind_checkpoint, checkpoint_tensors, compile_graphs, random_weights, weight_specs
    import ir
    spec = ir.load_spec(TINY)
    one = weight_specs(compile_graphs(spec).graphs)
    whole = checkpoint_tensors(one, random_weights(one, dtype=torch.float32, device="cpu", seed=3))
    for rank in (0, 1):
        specs = weight_specs(compile_graphs(spec, world=2, rank=rank).graphs)
        part = random_weights(specs, dtype=torch.float32, device="cpu", seed=3)
        want = bind_checkpoint(specs, whole)
        assert part.keys() == want.keys()
        for name, t in part.items():
            assert torch.equal(t, want[name]), name
