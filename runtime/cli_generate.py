"""`dsgraph generate`: run a checkpoint (or a spec with random weights) from the command line.

    dsgraph generate --model DIR (--prompt TEXT | --ids 1,2,3) [--max-new-tokens N]
                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--ignore-eos]
                     [--backend cuda|reference] [--dtype bf16] [--device cuda]
    dsgraph generate --random-weights [--spec SPEC] --ids 1,2,3 ...
    torchrun --nproc-per-node N --no-python dsgraph generate ...     (tensor / expert parallel; --tp N)

With a tokenizer in the model directory (read offline) --prompt is tokenised and the
answer decoded; otherwise token ids are printed.  Generation stops at the model's eos
token unless --ignore-eos.  Under torchrun every rank runs its part of the model and rank 0
alone prints.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from codegen.paths import DEFAULT_SPEC


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR",
                   help="a Hugging Face DeepSeek-V2/V3 checkpoint directory (safetensors + config.json)")
    p.add_argument("--spec", metavar="SPEC.yaml",
                   help="the model spec (default: written from DIR/config.json; with --random-weights: "
                        f"model_specs/{DEFAULT_SPEC.name})")
    p.add_argument("--random-weights", action="store_true", help="no checkpoint: run the spec with random weights")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (needs a tokenizer in DIR)")
    src.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: a fresh one)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the model's eos token")
    p.add_argument("--backend", choices=("cuda", "reference"), default=None,
                   help="default: cuda when a GPU is present, else reference")
    p.add_argument("--device", default=None,
                   help="default: cuda when a GPU is present or --backend cuda is asked for, else cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--bundle", metavar="DIR", help="run a bundle made by `dsgraph compile` (backend cuda; its "
                   "spec, dtype and block size)")
    p.add_argument("--block-size", type=int, default=None,
                   help="KV-cache page size in tokens (default: the bundle's, else 64)")
    p.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                   help="longest sequence the KV cache holds (default: 8192, or the model's limit if lower)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="ranks to spread the model over, one process each: launch with torchrun "
                        "--nproc-per-node N (default: torchrun's WORLD_SIZE, else 1)")


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
    from .errors import require_runtime
    require_runtime("generate")
    import torch

    from .engine import Engine, check_device
    from .errors import InputError
    from .sampling import SamplingParams

    cuda = torch.cuda.is_available()
    # --backend cuda (or a bundle) without --device means the GPU: say so if there is none.
    device = args.device or ("cuda" if cuda or args.backend == "cuda" or args.bundle else "cpu")
    backend = args.backend or ("cuda" if device.startswith("cuda") else "reference")
    dtype = args.dtype or (None if args.bundle else "bf16" if device.startswith("cuda") else "fp32")
    check_device(backend, device)  # before the tokenizer, the spec and any weight
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
    tp = args.tp if args.tp is not None else int(os.environ.get("WORLD_SIZE", "1") or 1)
    main_rank = os.environ.get("RANK", "0") == "0"
    kwargs = dict(backend=backend, device=device, dtype=dtype, bundle=args.bundle, max_seq_len=args.max_seq_len)
    if tp != 1:
        kwargs["tp"] = tp
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    t0 = time.perf_counter()
    if args.random_weights:
        engine = Engine.from_spec(None if args.bundle else args.spec or str(DEFAULT_SPEC), **kwargs)
    else:
        engine = Engine.from_pretrained(args.model, spec=args.spec, progress=main_rank, **kwargs)
    t1 = time.perf_counter()
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    out = engine.generate([ids], params)[0]
    t2 = time.perf_counter()
    if not main_rank:
        return 0                # every rank holds the same tokens; rank 0 prints them
    if tok is not None:
        print(tok.decode(out.token_ids, skip_special_tokens=True))
    print("ids:", ",".join(map(str, out.token_ids)))
    ranks = f", {tp} ranks" if tp != 1 else ""
    print(f"[{backend} {dtype} on {device}{ranks}] load {t1 - t0:.1f}s, {len(out.token_ids)} tokens in {t2 - t1:.2f}s "
          f"({out.finish_reason})", file=sys.stderr)
    return 0
