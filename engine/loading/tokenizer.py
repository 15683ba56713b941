"""The tokenizer and chat template of a Hugging Face model directory, without transformers.

`tokenizer.json` is run by the `tokenizers` library; the chat template is rendered with jinja2 the
way transformers renders it (same sandbox, whitespace rules, globals and `tojson`), so a prompt
built here is token-for-token the prompt the model was trained with.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

from engine.errors import UserError


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_OF = {ch: byte for byte, ch in byte_alphabet().items()}


class TokenizerError(UserError, ValueError):
    """The tokenizer files or the chat template cannot be used; the message names the file and why."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; transformers' does not, and templates rely on that
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _compile_template(source: str, origin: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"{origin}: chat template syntax error at line {e.lineno}: {e.message}") from None


def _token_string(value, key: str, origin: Path) -> str | None:
    """Special tokens are stored as plain strings or as AddedToken dicts with a "content" key."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{origin}: {key} must be a string or {{\"content\": ...}}, found {value!r}")


def _chat_template(config_template, directory: Path) -> tuple[str | None, str]:
    """(template source, where it came from): chat_template.jinja wins, as in transformers."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    origin = str(directory / "tokenizer_config.json")
    if isinstance(config_template, list):  # older files: a list of named templates
        named = {t.get("name"): t.get("template") for t in config_template if isinstance(t, dict)}
        return named.get("default"), origin
    return config_template, origin


class Tokenizer:
    """Text <-> ids, special tokens, and the model's chat template."""

    def __init__(self, rust: RustTokenizer, config: dict, chat_template: str | None, template_origin: str,
                 config_file: Path):
        self._rust = rust
        self.bos_token = _token_string(config.get("bos_token"), "bos_token", config_file)
        self.eos_token = _token_string(config.get("eos_token"), "eos_token", config_file)
        self.chat_template = chat_template
        self._template_origin = template_origin
        self._compiled: jinja2.Template | None = None
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.special_token_ids = frozenset(
            i for i, token in rust.get_added_tokens_decoder().items() if token.special)

    @property
    def vocab_size(self) -> int:
        return self._rust.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it: 0.85 s for a 1 MB text),
        # so a long prompt tokenized on a worker thread stalls neither the server nor the engine
        return self._rust.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._rust.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a character, for a byte-level BPE token that
        splits one), where decoding it alone would give U+FFFD."""
        token = self._rust.id_to_token(token_id)
        if token is None:
            return b""
        if token_id in self.special_token_ids or not set(token) <= _BYTE_OF.keys():
            return self.decode([token_id], skip_special_tokens=False).encode()
        return bytes(_BYTE_OF[ch] for ch in token)

    def to_json(self) -> str:
        """tokenizer.json's content (for llguidance, engine/grammar.py)."""
        return self._rust.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._rust.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._rust.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text for `messages`; `extra` (tools, enable_thinking, ...) reaches the template."""
        if self.chat_template is None:
            raise TokenizerError(f"{self._template_origin}: the model has no chat template; "
                                 f"send a plain prompt (completion) instead of messages")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template, self._template_origin)
        # transformers passes only the special tokens that are set: an unset one is undefined, not None
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v}
        variables = {"tools": None, "documents": None, **specials, **extra}
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"{self._template_origin}: chat template error: {e.message}") from None

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra))


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model directory: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    directory = Path(path).expanduser()
    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerError(f"{tokenizer_file}: missing; pagedserve needs the fast-tokenizer file "
                             f"tokenizer.json from the model repository")
    try:
        rust = RustTokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # the Rust side raises a bare Exception for any parse problem
        raise TokenizerError(f"{tokenizer_file}: cannot be parsed ({e})") from None
    config_file = directory / "tokenizer_config.json"
    config: dict = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{config_file}: not valid JSON ({e.msg} at line {e.lineno})") from None
    template, origin = _chat_template(config.get("chat_template"), directory)
    return Tokenizer(rust, config, template, origin, config_file)
