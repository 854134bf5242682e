"""A word-level tokenizer for the tiny test checkpoints, built offline (nothing is downloaded) and
saved beside them as transformers saves one, with a chat template: what `dsgraph serve` and
`generate --prompt` read from a real checkpoint folder."""
from __future__ import annotations

from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>", "<|user|>", "<|system|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def words(vocab: int) -> list[str]:
    """The vocabulary's ordinary words, w0 w1 ... (ids len(SPECIAL) onwards)."""
    return [f"w{i}" for i in range(vocab - len(SPECIAL))]


def save_tokenizer(model_dir: Path, vocab: int) -> Path:
    """A tokenizer of exactly `vocab` ids (the model's vocabulary) saved into model_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    table = {w: i for i, w in enumerate(SPECIAL + words(vocab))}
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")     # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   additional_special_tokens=SPECIAL[3:], chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(model_dir)
    return Path(model_dir)
