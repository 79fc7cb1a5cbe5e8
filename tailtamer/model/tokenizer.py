"""Tokenizers: HF `tokenizer.json` via the `tokenizers` library, chat templates, and the
built-in character-level tokenizer of the built-in task.

Chat templates are rendered the way transformers renders them (a sandboxed Jinja2
environment with trim_blocks / lstrip_blocks, `raise_exception` and a `tojson` filter), so a
prompt formatted here tokenizes exactly as `apply_chat_template` would.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

from tailtamer.atomic import atomic_write, atomic_write_json
from tailtamer.errors import CheckpointError, DataError
from tailtamer.model.dirs import check_model_dir

CHAR_SPECIALS = ("<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>")
CHAR_ALPHABET = ("\n",) + tuple(chr(i) for i in range(32, 127))
# ChatML, as Qwen2 uses it, without a default system prompt.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the fields of `tokenizer_config.json` tailtamer uses (the
    chat template from `chat_template.jinja` when there is one, as transformers reads it)."""

    def __init__(self, backend: HFTokenizer, config: dict | None = None, template_source: Path | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template: str | None = self.config.get("chat_template")
        # the file the template came from, which an error in the template itself names
        self.template_source = template_source

    # Special tokens may be given as strings or as {"content": ...} dicts (older configs).
    def _special(self, name: str) -> str | None:
        value = self.config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def eos_token(self) -> str | None:
        return self._special("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self._special("bos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special("pad_token")

    def token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise DataError("this tokenizer has no chat_template, so `messages` prompts cannot be formatted")
        try:
            _compile_template(self.chat_template)
        except Exception as e:  # the model's file is wrong, whatever the row
            raise CheckpointError(f"{self.template_source or 'the tokenizer'}: its chat template does not parse "
                                  f"({type(e).__name__}: {e})") from None
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            pad_token=self.pad_token or "", source=self.template_source,
        )

    def save(self, out_dir: str | Path) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(out_dir / "tokenizer.json", lambda tmp: self.backend.save(tmp))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.config}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        atomic_write_json(out_dir / "tokenizer_config.json", config)


@lru_cache(maxsize=16)
def _compile_template(template: str):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise DataError(f"chat template error: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         source: Path | None = None, **special_tokens: str) -> str:
    """The template rendered for `messages`. What the template raises (`raise_exception`: the
    messages break its rules) is the row's error; any other failure of the template's code
    (undefined names, the sandbox, arithmetic) names its file (`source`) too, as either may be
    at fault."""
    try:
        return _compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens)
    except DataError:
        raise
    except Exception as e:  # the template is the model's code: syntax, undefined names, sandbox, arithmetic
        where = f" ({source})" if source is not None else ""
        raise DataError(f"chat template error{where}: {type(e).__name__}: {e}") from None


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    model_dir = Path(model_dir)
    check_model_dir(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: " + ("not a file" if path.exists() else "tokenizer.json not found"))
    try:
        backend = HFTokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on parse errors
        raise CheckpointError(f"{path}: cannot parse tokenizer ({e})") from None
    config_path = model_dir / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{config_path}: malformed JSON ({e})") from None
        config = _checked_config(config, config_path)
    # transformers >= 4.43 saves the template as a file of its own, which wins over the config's
    template_path = model_dir / "chat_template.jinja"
    source = config_path if config.get("chat_template") else None
    if template_path.is_file():
        try:
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{template_path}: not UTF-8 text ({e})") from None
        source = template_path
    return Tokenizer(backend, config, source)


def _checked_config(config, path: Path) -> dict:
    """tokenizer_config.json fields tailtamer reads, checked; a list of named chat templates
    (transformers' format for several) becomes its `default` one."""
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{path}: {name} must be a token string, got {config[name]!r}")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if template is not None and not isinstance(template, str):
        raise CheckpointError(f"{path}: chat_template must be a string (or a list of named templates)")
    return {**config, "chat_template": template} if "chat_template" in config else config


def byte_level_symbol(char: str) -> str:
    """The symbol byte-level BPE (GPT-2's, Qwen's) writes an ASCII character as: printable
    ones stand for themselves, the others (space, newline) for chr(256 + n), n counting the
    non-printable bytes below them (so ' ' is 'Ġ' and '\\n' is 'Ċ')."""
    byte = ord(char)
    if 33 <= byte <= 126:
        return char
    return chr(256 + sum(1 for b in range(byte) if not 33 <= b <= 126))


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character plus newline, and five special tokens.

    Written as a byte-level BPE with no merges (the vocabulary in byte-level symbols), so text
    splits into single characters here and in transformers alike: transformers ≥ 5 rebuilds
    the tokenizer of any Qwen2 directory as its own byte-level `Qwen2Tokenizer` from the
    vocabulary, and a plain character vocabulary lost its spaces and newlines there. A character
    outside the alphabet is one <unk> per UTF-8 byte (it was one <unk>; Qwen2Tokenizer drops it).
    """
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS + tuple(byte_level_symbol(c) for c in CHAR_ALPHABET))}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAR_SPECIALS])
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    config = {"eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>", "bos_token": None,
              "model_max_length": 1024, "chat_template": CHATML_TEMPLATE}
    return Tokenizer(backend, config)
