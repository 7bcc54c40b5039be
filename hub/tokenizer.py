"""Tokenizer (``tokenizer.json`` through the ``tokenizers`` library) and chat template.

The chat template is the model's own Jinja template (``tokenizer_config.json`` ->
``chat_template``), rendered in a sandbox with the variables Hugging Face templates expect.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from common.errors import InvalidRequestError, ModelNotFoundError, UnsupportedModelError

CHAT_ROLES = ("system", "user", "assistant", "tool")


def _raise_exception(message: str):
    raise TemplateError(message)


def validate_messages(messages: list[dict]) -> None:
    """Raise InvalidRequestError (naming the message) unless every role and content is valid."""
    if not messages:
        raise InvalidRequestError("messages", "at least one message is required")
    for i, m in enumerate(messages):
        if m.get("role") not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role", f"unknown role {m.get('role')!r}; "
                                      f"expected one of {', '.join(CHAT_ROLES)}")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content", "content must be a string")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                           extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        self._template = env.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        validate_messages(messages)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **self._tokens)
        except TemplateError as exc:
            raise InvalidRequestError("messages", f"the model's chat template rejected them: {exc}") from None


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        root = Path(model_dir)
        if not (root / "tokenizer.json").is_file():
            raise ModelNotFoundError(f"{str(root)!r} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(root / "tokenizer.json"))
        # A second copy that reads special-token strings as text: a message's content is the
        # user's text, and "<|im_start|>system" in it must not become a role switch.
        self._literal = HFTokenizer.from_file(str(root / "tokenizer.json"))
        self._literal.encode_special_tokens = True
        self._special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        config_file = root / "tokenizer_config.json"
        tcfg = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self.bos_token = _token_text(tcfg.get("bos_token"))
        self.eos_token = _token_text(tcfg.get("eos_token"))
        self.add_bos = bool(tcfg.get("add_bos_token", False)) and bool(self.bos_token)
        source = tcfg.get("chat_template")
        if isinstance(source, list):  # some models ship [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.chat_template = ChatTemplate(source, self.bos_token, self.eos_token) if source else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognised as such."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self.add_bos and not text.startswith(self.bos_token):
            ids = [self.token_to_id(self.bos_token), *ids]
        return ids

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered with the chat template: the template's own special
        tokens are parsed, special-token strings inside a message's content stay text."""
        text = self.apply_chat_template(messages, add_generation_prompt)
        literal = [i for i, m in enumerate(messages) if any(s in m["content"] for s in self._special)]
        if not literal:
            return self.encode(text)
        ids = []
        for k, piece in enumerate(self._split_contents(messages, literal, add_generation_prompt, text)):
            ids += (self._literal if k % 2 else self._tok).encode(piece, add_special_tokens=False).ids
        if self.add_bos and not text.startswith(self.bos_token):
            ids = [self.token_to_id(self.bos_token), *ids]
        return ids

    def _split_contents(self, messages: list[dict], literal: list[int], add_generation_prompt: bool,
                        text: str) -> list[str]:
        """``text`` cut into template text and the contents of messages ``literal``, alternating.

        Where each content sits comes from a second rendering with a unique stand-in for it: searching
        ``text`` for the content itself could match the template's own text first ("<|im_start|>" as
        content matched the template's opening marker, which then became text and the content a turn).
        """
        marks = {i: f"\ue000{i}\ue001" for i in literal}  # private-use characters: no template or tokenizer uses them
        stand_ins = [{**m, "content": marks[i]} if i in marks else m for i, m in enumerate(messages)]
        skeleton = self.apply_chat_template(stand_ins, add_generation_prompt)
        if any(skeleton.count(mark) != 1 for mark in marks.values()):
            raise _rewritten()
        for keep in (lambda c: c, str.strip):  # some templates trim the content
            pieces, rest = [], skeleton
            for i in literal:
                before, rest = rest.split(marks[i])
                pieces += [before, keep(messages[i]["content"])]
            if "".join([*pieces, rest]) == text:
                return [*pieces, rest]
        raise _rewritten()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context: list[int], skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """Incremental decoding after ``context`` (ids decoded before the first new one, so a leading
        space merges as in the full decode): a function of one new id returning the text it makes
        final (None while a multi-byte character is incomplete). The tokenizers library's
        ``DecodeStream``: one call per token, its window kept a few tokens long."""
        stream, tok = DecodeStream(list(context), skip_special_tokens=skip_special_tokens), self._tok
        return lambda token: stream.step(tok, token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise UnsupportedModelError("this model ships no chat template; send a plain prompt instead")
        return self.chat_template.render(messages, add_generation_prompt)


def _rewritten() -> InvalidRequestError:
    return InvalidRequestError("messages", "a message holds special-token text that the chat template rewrites; "
                                           "it cannot be kept as text")


def _token_text(value) -> str:
    # tokenizer_config stores special tokens either as strings or as {"content": ...} objects.
    if isinstance(value, dict):
        return value.get("content", "")
    return value or ""
