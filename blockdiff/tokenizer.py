"""The checkpoint's tokenizer (tokenizer.json via `tokenizers`) and its jinja2 chat template."""

from __future__ import annotations

import contextvars
import functools
import json
import logging
import os
import re
from collections.abc import Callable
from datetime import datetime

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Tokenizer

from blockdiff.config import read_json

log = logging.getLogger(__name__)


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, tokenizer: _Tokenizer, config: dict, chat_template: str | None):
        self._tok = tokenizer
        self.config = config  # tokenizer_config.json as read: /tokenizer_info serves it
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", True)) and self.bos_token is not None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.unk_token = _token_text(config.get("unk_token"))
        self.unk_token_id = self._tok.token_to_id(self.unk_token) if self.unk_token else None
        self.chat_template = chat_template
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_pretrained(cls, path: str, chat_template: str | None = None) -> "Tokenizer | None":
        """None when the checkpoint has no tokenizer.json (token-id prompts still work).
        `chat_template` replaces the checkpoint's."""
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            return None
        config = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            config = read_json(config_file)
        template = chat_template or config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                template = f.read()
        try:
            tok = _Tokenizer.from_file(file)
        except Exception as e:  # the tokenizers library raises its own exception types
            raise ValueError(f"{file} cannot be loaded: {e}") from None
        return cls(tok, config, template)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: an upper bound on the text one token covers
        (entries spell a byte, a character or a space marker per character, or are byte-fallback
        `<0xNN>`), so text longer than N times this cannot encode to N tokens or fewer."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    @functools.cached_property
    def mean_token_bytes(self) -> float:
        """UTF-8 bytes of the average vocabulary entry: what a token's text takes in a response,
        about (a space marker's 3 bytes decode to 1, so ordinary text runs below it)."""
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return sum(len(t.encode()) for t in vocab) / max(1, len(vocab))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def unknown_text(self, text: str, ids: list[int]) -> str:
        """The characters of `text` that its encoding `ids` holds only as the unknown token ("" when
        none: always so with byte fallback). Encodes again only when `ids` has an unknown token."""
        if self.unk_token_id is None or self.unk_token_id not in ids:
            return ""
        enc = self._tok.encode(text, add_special_tokens=False)
        pieces = (text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == self.unk_token_id)
        return "".join(p for p in pieces if p != self.unk_token)  # a literal "<unk>" was meant

    def warn_unknown(self, where: str, text: str, ids: list[int]) -> None:
        """Log a warning, naming `where` (a request), when characters of `text` were lost."""
        lost = self.unknown_text(text, ids)
        if lost:
            shown = lost if len(lost) <= 40 else lost[:40] + "..."
            log.warning("%s: the tokenizer has no token for %d character(s) %r; they were encoded as %s",
                        where, len(lost), shown, self.unk_token)

    @functools.cached_property
    def special_tokens(self) -> re.Pattern | None:
        """The special tokens' texts, to drop them from text decoded with them: a chat whose
        parsers read the format's markers is decoded with its special tokens, and what the parsers
        leave as text must not carry them (vLLM's `skip_special_tokens`)."""
        texts = sorted({t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @functools.cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template; send a plain prompt instead")
        return _template_env().from_string(self.chat_template)

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables the chat template reads from outside (messages, tools, enable_thinking, ...):
        names it reads but never sets itself, jinja's globals aside."""
        if self.chat_template is None:
            return frozenset()
        env = _template_env()
        ast = env.parse(self.chat_template)
        # jinja2.meta also counts names a loop or macro body sets and then reads.
        stored = {n.name for n in ast.find_all(jinja2.nodes.Name) if n.ctx in ("store", "param")}
        return frozenset(jinja2.meta.find_undeclared_variables(ast) - stored - set(env.globals))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
        guard: Callable[[], None] | None = None, max_chars: int | None = None, continue_final_message: bool = False,
        documents: list[dict] | None = None, template: str | None = None, **kwargs
    ) -> str:
        """The conversation rendered as transformers' apply_chat_template renders it: the same
        environment and helpers, the same variables (tools, documents, the special tokens), and a
        message's reasoning under each name templates read it by.

        `guard` is called on every item access, attribute access and call the template makes (a
        deadline check may raise from it); rendering stops with a ValueError once the text passes
        `max_chars`. Whatever the template raises on this input is a ValueError too, as is recursion
        too deep for Python (a recursive macro over deeply nested arguments).

        `continue_final_message`: the text ends inside the last message, after its content, so that
        the model continues it (transformers' and vLLM's option). `template`: a chat template of the
        caller's own instead of the checkpoint's, in the same sandbox."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message, add_generation_prompt starts a new "
                             "one: set at most one")
        compiled = self._compiled_template if template is None else _compile_template(template)
        variables = dict(
            messages=[_alias_reasoning(m) for m in messages],
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            unk_token=self.unk_token or "",
            **kwargs,
        )
        token = _guard.set(guard)
        try:
            pieces, length = [], 0
            for piece in compiled.generate(**variables):
                length += len(piece)
                if max_chars is not None and length > max_chars:
                    raise ValueError(f"the chat template's text passed {max_chars} characters, more than the context "
                                     "can hold")
                pieces.append(piece)
            text = "".join(pieces)
            return _continued(text, messages) if continue_final_message else text
        except ValueError:
            raise
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from e
        except RecursionError:
            raise ValueError("chat template failed: the messages nest too deeply for it") from None
        except Exception as e:  # the template's own code on input it was not written for
            raise ValueError(f"chat template failed on these messages: {type(e).__name__}: {e}") from None
        finally:
            _guard.reset(token)

    def encode_chat(self, messages: list[dict], **template_kwargs) -> list[int]:
        """The prompt ids of a conversation; the template writes any BOS itself."""
        return self.encode(self.apply_chat_template(messages, **template_kwargs), add_special_tokens=False)


# The names a message's reasoning goes by; templates read "reasoning_content", gpt-oss ones "thinking".
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Not jinja's own filter, which escapes HTML characters: templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` without underscore-prefixed attributes, which would reach Python internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attributes, got {name!r}")


class _Dict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the class itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


# The render's guard (apply_chat_template's `guard`), read by the environment's hooks below.
_guard: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("chat_template_guard", default=None)


class _GuardedEnvironment(ImmutableSandboxedEnvironment):
    """Every subscript, attribute and call of a sandboxed template goes through these three: the
    render's guard runs on each, so a long render can be stopped wherever it loops."""

    def getitem(self, obj, argument):
        guard = _guard.get()
        if guard is not None:
            guard()
        return super().getitem(obj, argument)

    def getattr(self, obj, attribute):
        guard = _guard.get()
        if guard is not None:
            guard()
        return super().getattr(obj, attribute)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        guard = _guard.get()
        if guard is not None:
            guard()
        return super().call(__context, __obj, *args, **kwargs)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    try:
        return _template_env().from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template does not compile: {e}") from None


def _continued(text: str, messages: list[dict]) -> str:
    """`text` cut after the last message's content, as transformers cuts it for continue_final_message."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    if not isinstance(content, str) or not content.strip() or content.strip() not in text:
        raise ValueError("continue_final_message: the last message's text content is not in the rendered conversation")
    end = text.rindex(content.strip()) + len(content.strip())
    return text[:end]


@functools.cache
def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment Hugging Face chat templates are written for (transformers' own)."""
    env = _GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


def _raise(message: str):
    raise jinja2.TemplateError(message)
