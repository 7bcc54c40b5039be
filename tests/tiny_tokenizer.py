"""A byte-level tokenizer with a chat template, written beside a tiny model: text and chat prompts
without the SmolLM2 download.

Ids 0..255 are the bytes themselves (no merges), 256..258 the special tokens, so a model of
``VOCAB_SIZE`` can emit any id and every output decodes, invalid UTF-8 included.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
BOS_ID, EOS_ID = 256, 258
# ChatML, content trimmed (as Llama 3's template does): the tokenizer must find content the template changed.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_tokenizer(model_dir: Path) -> None:
    """tokenizer.json and tokenizer_config.json (eos <|im_end|>, the chat template) in ``model_dir``."""
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(_byte_chars())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": SPECIAL_TOKENS[0], "eos_token": SPECIAL_TOKENS[2], "chat_template": CHAT_TEMPLATE}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
