"""`dsgraph generate`: run a checkpoint (or a spec with random weights) from the command line.

    dsgraph generate --model DIR (--prompt TEXT | --ids 1,2,3) [--max-new-tokens N]
                     [--temperature T] [--top-k K] [--top-p P] [--seed S]
                     [--backend cuda|reference] [--dtype bf16] [--device cuda]
    dsgraph generate --random-weights [--spec SPEC] --ids 1,2,3 ...

With a tokenizer in the model directory (read offline) --prompt is tokenised and the
answer decoded; otherwise token ids are printed.
"""
from __future__ import annotations

import argparse
import sys
import time


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="a Hugging Face DeepSeek-V2/V3 checkpoint directory")
    p.add_argument("--spec", metavar="SPEC.yaml", help="the model spec (default: written from DIR/config.json)")
    p.add_argument("--random-weights", action="store_true", help="no checkpoint: run the spec with random weights")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (needs a tokenizer in DIR)")
    src.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--backend", choices=("cuda", "reference"), default=None,
                   help="default: cuda when a GPU is present, else reference")
    p.add_argument("--device", default=None, help="default: cuda when a GPU is present, else cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--bundle", metavar="DIR", help="run a bundle made by `dsgraph compile` (backend cuda; its "
                   "spec, dtype and block size)")
    p.add_argument("--block-size", type=int, default=None, help="KV-cache page size (default: the bundle's, else 64)")
    p.add_argument("--max-seq-len", type=int, default=None)


class _Progress:
    """A one-line progress bar on stderr while a large checkpoint loads."""

    def __init__(self):
        self.start = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if total <= 0 or (not self.tty and done not in (0, total)):
            return
        width = 30
        filled = int(width * done / total)
        bar = "#" * filled + "-" * (width - filled)
        end = "\n" if done == total else "\r"
        print(f"loading weights [{bar}] {done}/{total} tensors {time.perf_counter() - self.start:5.1f}s",
              end=end, file=sys.stderr, flush=True)


def _tokenizer(model_dir):
    if model_dir is None:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer files: fall back to ids
        return None


def run_generate(args) -> int:
    """generate tokens from a checkpoint or a spec with random weights"""
    import torch

    from .engine import Engine
    from .errors import InputError
    from .sampling import SamplingParams

    cuda = torch.cuda.is_available()
    device = args.device or ("cuda" if cuda or args.bundle else "cpu")
    backend = args.backend or ("cuda" if device.startswith("cuda") else "reference")
    dtype = args.dtype or (None if args.bundle else "bf16" if device.startswith("cuda") else "fp32")
    if args.model is None and not args.random_weights:
        raise InputError("give --model DIR (a checkpoint) or --random-weights (with --spec, or the default spec)")
    tok = _tokenizer(args.model)
    if args.prompt is not None:
        if tok is None:
            raise InputError("--prompt needs a tokenizer in the model directory (none found); pass --ids instead")
        ids = tok(args.prompt)["input_ids"]
    else:
        try:
            ids = [int(x) for x in args.ids.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise InputError(f"--ids must be comma-separated integers, got {args.ids!r}") from None
    kwargs = dict(backend=backend, device=device, dtype=dtype, bundle=args.bundle, max_seq_len=args.max_seq_len)
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    t0 = time.perf_counter()
    if args.random_weights:
        from .cli import DEFAULT_SPEC
        engine = Engine.from_spec(None if args.bundle else args.spec or str(DEFAULT_SPEC), **kwargs)
    else:
        engine = Engine.from_pretrained(args.model, spec=args.spec, progress=_Progress(), **kwargs)
    t1 = time.perf_counter()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed,
                            stop_token_ids=(tok.eos_token_id,) if tok is not None and tok.eos_token_id is not None else ())
    out = engine.generate([ids], params)[0]
    t2 = time.perf_counter()
    if tok is not None:
        print(tok.decode(out.token_ids, skip_special_tokens=True))
    print("ids:", ",".join(map(str, out.token_ids)))
    print(f"[{backend} {dtype} on {device}] load {t1 - t0:.1f}s, {len(out.token_ids)} tokens in {t2 - t1:.2f}s "
          f"({out.finish_reason})", file=sys.stderr)
    return 0
