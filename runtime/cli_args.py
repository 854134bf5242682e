"""Option types the dsgraph commands share: a bad value is refused by argparse at the option, with
the range accepted, before any model is loaded or any kernel compiled."""
from __future__ import annotations

import argparse


def whole_number(low: int = 1, high: int | None = None):
    """An argparse type: a whole number from `low` to `high`; anything else is refused at the
    option, with the accepted range, before any work starts."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < low or (high is not None and n > high):
            accepted = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"must be a whole number {accepted}, got {text}")
        return n
    return parse


def block_size_arg(text: str) -> int:
    """--block-size: tokens per KV-cache page, in the range the kernels take (codegen/bundle.py)."""
    from codegen.bundle import MAX_BLOCK_SIZE
    return whole_number(1, MAX_BLOCK_SIZE)(text)


# The engine's arguments as the API names them in messages, and the command line's options for them.
_API_OPTIONS = ("num_blocks", "max_seq_len", "max_new_tokens", "max_num_seqs", "top_p", "top_k", "block_size")
_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def in_cli_terms(message: str) -> str:
    """A runtime message, written for the Python API (device='cpu', dtype=torch.float32, raise
    num_blocks), in the command line's terms (--device cpu, --dtype fp32, raise --num-blocks):
    what `dsgraph` prints when the engine refuses something."""
    import re
    message = re.sub(r"\b(device|backend)=(?:'([^']*)'|([\w:]+))",
                     lambda m: f"--{m.group(1)} {m.group(2) or m.group(3)}", message)
    message = re.sub(r"\bdtype=torch\.(float32|bfloat16|float16)\b",
                     lambda m: f"--dtype {_TORCH_DTYPES[m.group(1)]}", message)
    names = "|".join(_API_OPTIONS)
    message = re.sub(rf"(?<![\w-])({names})=", lambda m: f"--{m.group(1).replace('_', '-')} ", message)
    # a bare name, where a message tells what to change ("raise num_blocks"); block_size only with a value
    return re.sub(rf"(?<![\w-])({names.removesuffix('|block_size')})\b",
                  lambda m: f"--{m.group(1).replace('_', '-')}", message)


def add_tune_arg(p: argparse.ArgumentParser) -> None:
    """--tune SECTION.KNOB=VALUE, repeatable (codegen/tuning.py; `dsgraph explain` lists the knobs)."""
    p.add_argument("--tune", action="append", default=None, metavar="SECTION.KNOB=VALUE",
                   help="set a tuning knob, e.g. moe.expert_ffn_upto=128 (repeatable; default: dsgraph's "
                        "tuning; `dsgraph explain --knobs` lists them)")


def tuning_of(args):
    """The Tuning of the command's --tune flags (TuningError, one line, on a mistake)."""
    from codegen.tuning import parse_tune
    return parse_tune(getattr(args, "tune", None) or [])
