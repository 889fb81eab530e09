"""`FastTokenizer`: a `tokenizers.Tokenizer` with its special tokens and chat template, behind
the part of transformers' `PreTrainedTokenizerFast` surface the engine, the SDK and the
grammar use. A GGUF's tokenizer is one (gguf_tokenizer.py builds its backend), so loading a
GGUF model never imports transformers (about 1 s of start-up and 60+ MiB of memory).

    tok = FastTokenizer(backend, settings)
    tok.encode(text, add_special_tokens=True) -> ids   (BOS/EOS as the settings ask)
    tok.decode(ids, skip_special_tokens=False) -> text
    tok.apply_chat_template(messages, tools=..., tokenize=False, add_generation_prompt=True)
    tok.eos_token_id, tok.get_added_vocab(), tok.convert_ids_to_tokens(ids), len(tok), ...
    tok.backend_tokenizer                      -> the `tokenizers.Tokenizer` (DecodeStream)
    tok.to_transformers()                      -> an equivalent PreTrainedTokenizerFast, for
                                                  libraries that accept nothing else
                                                  (xgrammar, llguidance)
    tok.save_pretrained(dir)                   -> files `AutoTokenizer.from_pretrained` reads

Chat templates render as transformers renders them: a sandboxed jinja2 environment with
`trim_blocks`, `lstrip_blocks`, loop controls, a `tojson` that keeps non-ASCII text, and the
`raise_exception` and `strftime_now` globals; the special tokens are template variables.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from agentrt.engine.loader.gguf_tokenizer import TokenizerSettings

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class FastTokenizer:
    """One model's tokenizer. `chat_template` and `model_max_length` may be reassigned, as on
    a transformers tokenizer.

    The `tokenizers.Tokenizer` is never changed after construction (nothing here sets its
    truncation or padding, or adds tokens, as transformers' encode may), so threads may use
    it at once, and `copy.deepcopy` shares it as deepcopy shares any immutable value: a copy
    for another thread has its own settings and costs no second vocabulary (Qwen's 152k
    tokens: ~45 MiB)."""

    def __init__(self, backend: Any, settings: TokenizerSettings) -> None:
        self._tokenizer = backend
        self.bos_token = settings.bos_token
        self.eos_token = settings.eos_token
        self.pad_token = settings.pad_token
        self.unk_token = settings.unk_token
        self.add_bos_token = settings.add_bos_token
        self.add_eos_token = settings.add_eos_token
        self.chat_template = settings.chat_template
        # transformers' "no limit" value when the file names no context length.
        self.model_max_length = settings.model_max_length or int(1e30)

    def __deepcopy__(self, memo: dict) -> FastTokenizer:
        twin = copy.copy(self)
        memo[id(self)] = twin
        return twin

    # --- the vocabulary --------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Any:
        return self._tokenizer

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        return self._tokenizer.get_added_tokens_decoder()

    def get_added_vocab(self) -> dict[str, int]:
        return {str(token): index for index, token in self.added_tokens_decoder.items()}

    @property
    def all_special_tokens(self) -> list[str]:
        return [str(t) for t in self.added_tokens_decoder.values() if t.special]

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i, t in self.added_tokens_decoder.items() if t.special]

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in _SPECIAL_NAMES if getattr(self, name)}

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id(self.unk_token)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """Token text -> id (the unknown token's id for text that is no token)."""
        if isinstance(tokens, str):
            index = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if index is None else index
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(
        self, ids: int | Sequence[int], skip_special_tokens: bool = False
    ) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(i) for i in ids if i not in special]

    # --- text <-> ids --------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, Any]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: int | Sequence[int], skip_special_tokens: bool = False, **_: Any):
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in sequences]

    # --- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template (ids when `tokenize`, special tokens
        as the template wrote them). Raises `ValueError` when there is no template."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                "this tokenizer has no chat template; pass chat_template= or format the "
                "prompt yourself"
            )
        messages = _plain(list(conversation))
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        if continue_final_message:
            final = messages[-1]["content"]
            messages[-1]["content"] = final + tag
        text = _compiled(template).render(
            messages=messages,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **_plain(kwargs)},
        )
        if continue_final_message:
            cut = text.rindex(tag.strip())
            text = text[:cut] if text[cut : cut + len(tag)] == tag else text[:cut].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # --- other libraries ------------------------------------------------------------------

    def to_transformers(self) -> Any:
        """An equivalent transformers `PreTrainedTokenizerFast` (imports transformers): for
        libraries that accept nothing else (xgrammar, llguidance)."""
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=self._tokenizer,
            chat_template=self.chat_template,
            model_max_length=self.model_max_length,
            add_bos_token=self.add_bos_token,
            add_eos_token=self.add_eos_token,
            **self.special_tokens_map,
        )
        tokenizer.clean_up_tokenization_spaces = False
        return tokenizer

    def save_pretrained(self, save_directory: str | os.PathLike[str]) -> tuple[str, ...]:
        """tokenizer.json, tokenizer_config.json and chat_template.jinja, which
        `AutoTokenizer.from_pretrained` (transformers 4.45 and later) reads back as this
        tokenizer."""
        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{name: getattr(self, name) for name in _SPECIAL_NAMES},
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            "clean_up_tokenization_spaces": False,
            "model_max_length": self.model_max_length,
        }
        written = [out / "tokenizer.json", out / "tokenizer_config.json"]
        if self.chat_template:
            config["chat_template"] = self.chat_template  # what transformers 4.x reads
            (out / "chat_template.jinja").write_text(self.chat_template)
            written.append(out / "chat_template.jinja")
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return tuple(str(p) for p in written)


def _plain(value: Any) -> Any:
    """Plain JSON-like data for the template sandbox (pydantic models and dataclasses as dicts;
    a fresh copy, so the caller's messages are never edited)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return str(value)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): the
        body, rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
