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

from codegen.paths import DEFAULT_SPEC, SPEC_ARGUMENT, shipped_specs

from .cli_args import add_tune_arg, block_size_arg, tuning_of, whole_number


def token_ids(text: str) -> list[int]:
    """--ids "1,2,3" -> [1, 2, 3]: whole numbers, no empty item (a stray comma is a typo, not a
    separator to skip).  Whether each id is in the vocabulary, the engine says."""
    from .errors import InputError
    items = text.replace(" ", "").split(",")
    if "" not in items:
        try:
            return [int(x) for x in items]
        except ValueError:
            pass
    raise InputError(f"--ids must be comma-separated integers with no empty item, e.g. 1,2,3; got {text!r}")


def add_generate_args(p: argparse.ArgumentParser) -> None:
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--model", metavar="DIR",
                         help="a Hugging Face DeepSeek-V2/V3 checkpoint directory (safetensors + config.json)")
    weights.add_argument("--random-weights", action="store_true",
                         help="no checkpoint: run the spec with random weights")
    p.add_argument("--spec", metavar="SPEC",
                   help=f"the model spec: {SPEC_ARGUMENT} ({', '.join(shipped_specs())}; default: written from "
                        f"DIR/config.json; with --random-weights: {DEFAULT_SPEC.stem})")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (needs a tokenizer in DIR)")
    src.add_argument("--ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = all)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: a fresh one)")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past the model's eos token")
    add_engine_args(p)
    p.add_argument("--tp", type=whole_number(1), default=None, metavar="N",
                   help="ranks to spread the model over, one process each: launch with torchrun "
                        "--nproc-per-node N (default: torchrun's WORLD_SIZE, else 1)")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options `generate` and `serve` share (engine_kwargs reads them)."""
    p.add_argument("--backend", choices=("cuda", "reference"), default=None,
                   help="default: cuda when a GPU is present, else reference")
    p.add_argument("--device", default=None,
                   help="default: cuda when a GPU is present or --backend cuda is asked for, else cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--bundle", metavar="DIR", help="run a bundle made by `dsgraph compile` (backend cuda; its "
                   "spec, dtype and block size; default: none, the spec is compiled through the bundle cache)")
    p.add_argument("--block-size", type=block_size_arg, default=None,
                   help="KV-cache page size in tokens (default: the bundle's, else 64)")
    p.add_argument("--weight-format", choices=("fp8", "dtype"), default=None,
                   help="convert a checkpoint's weights as they load: fp8 quantises a bf16 checkpoint's linears "
                        "to DeepSeek-V3's FP8 blocks (the bytes `dsgraph quantize --to fp8` writes; half of what a "
                        "decode step reads), dtype widens an FP8 checkpoint to --dtype (default: as stored)")
    add_tune_arg(p)
    p.add_argument("--max-seq-len", type=whole_number(1), default=None, metavar="N",
                   help="longest sequence the KV cache holds (default: 8192, or the model's limit if lower)")
    p.add_argument("--num-blocks", type=whole_number(1), default=None, metavar="N",
                   help="KV-cache blocks (default: sized to the device)")
    p.add_argument("--max-num-batched-tokens", type=whole_number(1), default=None, metavar="N",
                   help="tokens one step runs at most: a longer prompt prefills in chunks, beside the "
                        "running sequences' decode tokens (default: no cap)")


def engine_kwargs(args) -> dict:
    """The Engine constructor's backend / device / dtype / cache arguments from add_engine_args'
    options, defaults filled in and the device checked (before any weight is read)."""
    import torch

    from .engine import check_device
    from .errors import InputError
    cuda = torch.cuda.is_available()
    # --backend cuda (or a bundle) without --device means the GPU: say so if there is none.
    device = args.device if args.device is not None else (
        "cuda" if cuda or args.backend == "cuda" or args.bundle else "cpu")
    backend = args.backend or ("cuda" if device.startswith("cuda") else "reference")
    dtype = args.dtype or (None if args.bundle else "bf16" if device.startswith("cuda") else "fp32")
    check_device(backend, device)
    kwargs = dict(backend=backend, device=device, dtype=dtype, bundle=args.bundle, max_seq_len=args.max_seq_len,
                  num_blocks=args.num_blocks)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    if args.weight_format is not None:
        if args.random_weights:
            raise InputError("--weight-format converts a checkpoint's weights as they load: give a checkpoint, "
                             "not --random-weights (random weights in FP8: `dsgraph bench --weights fp8`)")
        kwargs["weight_format"] = args.weight_format
    if args.tune:
        kwargs["tuning"] = tuning_of(args)
    return kwargs


# Files a Hugging Face tokenizer is read from: where one of them is present, a tokenizer that fails
# to load is a broken one (say why), not a checkpoint that ships none.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(model_dir, needed: bool, warn: bool, without: str = "printing token ids only"):
    """The model directory's tokenizer, or None.  `needed` (--prompt): no tokenizer is an InputError
    that says why.  Otherwise (--ids, the tokenizer only decodes the answer) a tokenizer whose files
    are there but do not load is a warning (when `warn`) that ends saying what happens `without` it."""
    from .errors import InputError
    if model_dir is None:
        why = "--random-weights has no model directory"
    elif not os.path.isdir(model_dir):
        from codegen.paths import missing_model_folder
        raise InputError(missing_model_folder(model_dir))      # before the tokenizer: the folder itself
    elif not (present := [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]):
        why = f"none in {model_dir}"
    else:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer, why = None, (f"reading {present[0]} needs transformers, which is not installed: "
                                            f"pip install 'dsgraph[serve]' (or transformers)")
        if AutoTokenizer is not None:
            try:
                return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            except Exception as e:  # noqa: BLE001 - whatever breaks reading the user's files is reported, with why
                reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
                why = f"cannot read it from {', '.join(present)}: {reason}"
        if not needed and warn:
            print(f"dsgraph: warning: the tokenizer in {model_dir}: {why}; {without}", file=sys.stderr)
    if needed:
        raise InputError(f"--prompt needs a tokenizer in the model directory ({why}); pass --ids instead")
    return None


def _torchrun_ranks(tp: int | None) -> tuple[int, bool]:
    """(ranks, whether this process prints): --tp, else torchrun's WORLD_SIZE, else 1; rank 0 prints.
    torchrun sets RANK and WORLD_SIZE together; one without the other, or a value that is not a
    rank, is refused here rather than run as a silent rank or a ValueError."""
    from .errors import InputError
    env = {}
    for name in ("WORLD_SIZE", "RANK"):
        text = os.environ.get(name, "")
        if text == "":
            continue
        try:
            env[name] = int(text)
        except ValueError:
            raise InputError(f"{name}={text!r} (set by torchrun) must be a whole number") from None
    if len(env) == 1:
        (given, value), = env.items()
        other = "RANK" if given == "WORLD_SIZE" else "WORLD_SIZE"
        raise InputError(f"{given}={value} is set but {other} is not: launch with torchrun --nproc-per-node N, "
                         f"which sets both (or unset {given})")
    if env:
        world, rank = env["WORLD_SIZE"], env["RANK"]
        if world < 1 or not 0 <= rank < world:
            raise InputError(f"RANK={rank} and WORLD_SIZE={world} are not a rank of a job: RANK must be "
                             f"0..WORLD_SIZE-1 (torchrun sets both)")
        return (tp if tp is not None else world), rank == 0
    return (tp if tp is not None else 1), True


def run_generate(args) -> int:
    """generate tokens from a checkpoint or a spec with random weights"""
    from .errors import require_runtime
    require_runtime("generate")
    from .engine import Engine
    from .errors import InputError
    from .sampling import SamplingParams

    # Everything the options alone decide, before the tokenizer, the spec and any weight.
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    ids = token_ids(args.ids) if args.ids is not None else None
    if args.model is None and not args.random_weights:
        raise InputError("give --model DIR (a checkpoint) or --random-weights (with --spec, or the default spec)")
    tp, main_rank = _torchrun_ranks(args.tp)
    kwargs = engine_kwargs(args)
    backend, device, dtype = kwargs["backend"], kwargs["device"], kwargs["dtype"]
    tok = load_tokenizer(args.model, needed=args.prompt is not None, warn=main_rank)
    if args.prompt is not None:
        ids = tok(args.prompt)["input_ids"]
    if tp != 1:
        kwargs["tp"] = tp
    t0 = time.perf_counter()
    if args.random_weights:
        engine = Engine.from_spec(None if args.bundle else args.spec or str(DEFAULT_SPEC), **kwargs)
    else:
        engine = Engine.from_pretrained(args.model, spec=args.spec, progress=main_rank, **kwargs)
    t1 = time.perf_counter()
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
