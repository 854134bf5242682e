"""What the engine checks before it allocates or reads anything: the device (a GPU asked for
where there is none), the memory the model needs (one line with the estimate and what is
available), and the loading progress bar (a tqdm bar on a terminal, nothing in a log)."""
from __future__ import annotations

import io
import math

import pytest
import torch

import runtime.engine as engine_mod
import runtime.memory as memory
from codegen.paths import DEFAULT_SPEC, MODEL_SPECS_DIR
from runtime import Engine, InputError
from runtime.cli import main
from runtime.kv_cache import PagedLatentCache
from runtime.model_loader import progress_bar, weight_specs

TINY = str(MODEL_SPECS_DIR / "deepseek_tiny.yaml")
GiB = 1 << 30


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Fail the test if any weight would be drawn or read."""
    def refuse(*args, **kwargs):
        raise AssertionError("weights were allocated or read before the check")
    monkeypatch.setattr(engine_mod, "random_weights", refuse)
    monkeypatch.setattr(engine_mod, "load_model_weights", refuse)


# -- the device, before anything is read --------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("kwargs", [dict(backend="cuda", device="cuda"), dict(backend="reference", device="cuda")])
def test_a_missing_gpu_is_reported_before_the_checkpoint_is_touched(kwargs, tmp_path, monkeypatch,
                                                                   nothing_allocated):
    monkeypatch.setattr(engine_mod, "load_config", lambda *a: pytest.fail("config read before the device check"))
    with pytest.raises(InputError, match="needs a CUDA GPU and torch sees none"):
        Engine.from_pretrained(tmp_path, **kwargs)
    with pytest.raises(InputError, match="needs a CUDA GPU and torch sees none"):
        Engine.from_spec(TINY, **kwargs)


def test_the_cuda_backend_needs_a_cuda_device(nothing_allocated):
    with pytest.raises(InputError, match="backend='cuda' runs the generated kernels on a CUDA device"):
        Engine.from_spec(TINY, backend="cuda", device="cpu")
    with pytest.raises(InputError, match="backend must be one of"):
        Engine.from_spec(TINY, backend="tensorrt")
    with pytest.raises(InputError, match="not a torch device"):
        Engine.from_spec(TINY, device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cli_backend_cuda_without_a_gpu_is_one_line_before_loading(tmp_path, capsys, monkeypatch, nothing_allocated):
    monkeypatch.setattr(engine_mod, "load_config", lambda *a: pytest.fail("config read before the device check"))
    rc = main(["generate", "--model", str(tmp_path), "--ids", "1,2,3", "--backend", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "needs a CUDA GPU" in err and "Traceback" not in err


# -- memory: the estimate, and the guard ----------------------------------------------------

def test_estimate_is_what_the_engine_allocates():
    engine = Engine.from_spec(TINY, block_size=16, max_seq_len=256, max_num_seqs=4)
    est = engine_mod.estimate_memory(engine.spec, weight_specs(engine.graphs), dtype=torch.float32, device=torch.device("cpu"),
                                     block_size=16, max_seq_len=256, max_num_seqs=4)
    assert est.weights == sum(t.numel() * t.element_size() for t in engine.backend.weights.values())
    assert est.kv_cache == engine.cache.nbytes == 4 * math.ceil(256 / 16) * PagedLatentCache.bytes_per_block(
        engine.spec.dims["layers"], 16, engine.spec.model.cache_width, torch.float32)
    assert est.total == est.weights + est.kv_cache + est.margin and est.margin >= memory.MIN_MARGIN
    bf16 = engine_mod.estimate_memory(engine.spec, weight_specs(engine.graphs), dtype=torch.bfloat16, device=torch.device("cpu"),
                                      block_size=16, max_seq_len=256, max_num_seqs=4)
    assert bf16.weights < est.weights and bf16.kv_cache == est.kv_cache // 2   # routers stay float32


def test_too_big_is_one_line_with_the_estimate_and_what_is_available(monkeypatch, nothing_allocated):
    monkeypatch.setattr(memory, "available_bytes", lambda device: 3 * GiB)
    with pytest.raises(InputError) as info:
        Engine.from_spec(str(DEFAULT_SPEC))           # DeepSeek-V2-Lite in fp32: about 63 GB of weights
    msg = str(info.value)
    assert "\n" not in msg
    assert "deepseek_v2_lite with random weights needs about" in msg and "weights 58.5 GiB in float32" in msg
    assert "but cpu has 3.0 GiB available" in msg and "deepseek_tiny.yaml" in msg


def test_the_readme_smoke_command_on_a_small_machine_fails_in_one_line(monkeypatch, capsys, nothing_allocated):
    """The full spec on a 24 GB machine: the estimate, not an allocator traceback."""
    monkeypatch.setattr(memory, "available_bytes", lambda device: 24 * GiB)
    rc = main(["generate", "--random-weights", "--ids", "1,2,3", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "needs about" in err and "24.0 GiB available" in err


def test_what_fits_runs(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: memory.MIN_MARGIN + (64 << 20))
    assert Engine.from_spec(TINY, max_seq_len=64).spec.name == "deepseek_tiny"   # 3 MB of weights, 1 MB of cache
    monkeypatch.setattr(memory, "available_bytes", lambda device: memory.MIN_MARGIN)
    with pytest.raises(InputError, match="needs about"):
        Engine.from_spec(TINY, max_seq_len=64)


def test_available_memory_sources(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n")
    monkeypatch.setattr(memory, "_MEMINFO", str(meminfo))
    assert memory.available_bytes("cpu") == 20000000 * 1024
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (123 << 20, 456 << 20))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    assert memory.available_bytes("cuda") == 123 << 20
    # blocks torch's allocator caches unused are available to the engine's allocations too
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 100 << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 30 << 20)
    assert memory.available_bytes("cuda") == (123 + 70) << 20
    assert memory.available_bytes("meta") is None


# -- the loading progress bar ----------------------------------------------------------------

class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream, shown", [(_Terminal, True), (io.StringIO, False)])
def test_progress_bar_draws_on_a_terminal_and_stays_out_of_logs(monkeypatch, stream, shown):
    err = stream()
    monkeypatch.setattr("sys.stderr", err)
    update = progress_bar()
    for done in range(0, 51):
        update(done, 50)
    text = err.getvalue()
    if shown:
        assert "loading weights" in text and "/50" in text
    else:
        assert text == ""
