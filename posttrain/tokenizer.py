"""Tokenizer: a thin wrapper around a Hugging Face fast tokenizer, plus a built-in byte tokenizer.

What it is: `Tokenizer.from_pretrained(folder)` loads tokenizer.json / tokenizer_config.json /
chat_template.jinja from a local folder (never the network) and exposes the few things training
and sampling need: encode, decode, chat templates, and the special ids (bos, eos, pad, and every
id that should stop generation). `byte_tokenizer()` builds a 263-token byte-level tokenizer in
memory, so tests and demos run with no downloaded files.

What it is not: not a reimplementation of tokenization (transformers and `tokenizers` do that
work), not a data pipeline (no batching, padding or loss masks here), and not a hub client.
The underlying transformers tokenizer is `Tokenizer.hf` for anything not wrapped.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RawTokenizer

from posttrain.chat_template import render
from posttrain.errors import PosttrainError

# A folder must hold at least one of these for transformers to build a fast tokenizer from it.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
GENERATION_CONFIG = "generation_config.json"

BYTE_SPECIALS = ("<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
BYTE_OFFSET = len(BYTE_SPECIALS)  # byte b has id BYTE_OFFSET + b

# bos first so a chat sequence looks like an encode() sequence. The {% generation %} block
# covers the assistant content and its <|end|> (the model must learn to emit <|end|>), so
# hf.apply_chat_template(..., return_assistant_tokens_mask=True) marks exactly the tokens an
# SFT loss should train on (checked against transformers 5.12).
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class _Light:
    """What Tokenizer needs from a fast tokenizer, from the `tokenizers` library alone (no transformers, no torch).

    Built for folders whose tokenizer_config.json names the generic classes (PreTrainedTokenizerFast /
    TokenizersBackend: what transformers loads straight from tokenizer.json) and for byte_tokenizer();
    any other folder is loaded through transformers (see `_light_from_folder`)."""

    def __init__(self, raw: RawTokenizer, specials: dict, chat_template, name_or_path: str = "", files=None):
        self.raw = raw
        self.specials = {k: v for k, v in specials.items() if v is not None}  # bos_token -> "<bos>", ...
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.files = files  # the source folder's tokenizer files (save_pretrained copies them)

    def token_id(self, key):
        token = self.specials.get(key)
        return None if token is None else self.raw.token_to_id(token)

    def to_hf(self):
        """The same tokenizer as a transformers object (imports transformers, and with it torch)."""
        if self.files:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(self.files[0].parent), local_files_only=True)
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=self.raw, chat_template=self.chat_template, **self.specials)


# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES): the chat template sees them as variables.
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# tokenizer_config.json classes transformers builds from tokenizer.json as is; others rebuild parts of it.
_GENERIC_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")
_FAST_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _token_text(value):
    return value.get("content") if isinstance(value, dict) else value


def _light_from_folder(folder: Path):
    """A _Light for a folder transformers would load from tokenizer.json unchanged; None otherwise."""
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        cfg = json.loads((folder / "tokenizer_config.json").read_text()) \
            if (folder / "tokenizer_config.json").is_file() else {}
        stm = json.loads((folder / "special_tokens_map.json").read_text()) \
            if (folder / "special_tokens_map.json").is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # transformers reports it
    if not isinstance(cfg, dict) or not isinstance(stm, dict) or cfg.get("tokenizer_class") not in _GENERIC_CLASSES:
        return None
    if any(cfg.get(k) for k in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces")) or \
            "auto_map" in cfg or cfg.get("backend", "tokenizers") != "tokenizers":
        return None  # transformers rewrites the post-processor or the decoded text: leave it to transformers
    try:
        raw = RawTokenizer.from_file(str(folder / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a corrupt file: transformers' error message names it
        return None
    specials = {k: _token_text(cfg.get(k, stm.get(k))) for k in _SPECIAL_KEYS}
    extra = cfg.get("extra_special_tokens") or cfg.get("additional_special_tokens") or \
        stm.get("additional_special_tokens") or []
    names = [v for v in specials.values() if v is not None] + [_token_text(t) for t in
                                                               (extra.values() if isinstance(extra, dict) else extra)]
    if any(not isinstance(t, str) or raw.token_to_id(t) is None for t in names):
        return None  # transformers would add these tokens to the vocabulary
    template = cfg.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = {t["name"]: t["template"] for t in template}.get("default")
    if (folder / "additional_chat_templates").is_dir() or not (template is None or isinstance(template, str)):
        return None
    files = [folder / f for f in _FAST_FILES if (folder / f).is_file()]
    return _Light(raw, specials, template, str(folder), files)


class Tokenizer:
    """A fast tokenizer (encode/decode, chat template, special ids); `extra_eos_ids` are further ids that end
    generation.

    Folders in the generic fast-tokenizer format and byte_tokenizer() run on `tokenizers` + jinja2 alone;
    `Tokenizer.hf` builds (once, on first use; that imports transformers) the transformers tokenizer, after
    which every method goes through it, so changes made through `.hf` (added tokens, a new chat template)
    take effect."""

    def __init__(self, hf=None, extra_eos_ids=(), *, light: _Light | None = None):
        if (hf is None) == (light is None):
            raise ValueError("Tokenizer needs a transformers tokenizer or (internally) a light one")
        self._hf = hf
        self._light = light
        self.extra_eos_ids = tuple(int(i) for i in extra_eos_ids)

    @property
    def hf(self):
        """The transformers tokenizer (built from the same files on first use)."""
        if self._hf is None:
            self._hf = self._light.to_hf()
            self._light = None
        return self._hf

    @hf.setter
    def hf(self, value):
        self._hf, self._light = value, None

    @classmethod
    def from_pretrained(cls, path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise PosttrainError(
                f"tokenizer folder {folder} does not exist (or is not a folder); point the "
                f"tokenizer path at a local folder holding tokenizer.json, e.g. the model checkpoint folder"
            )
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            raise PosttrainError(
                f"tokenizer folder {folder} has no tokenizer files (expected one of "
                f"{', '.join(TOKENIZER_FILES)}); copy them from the model's release or write them "
                f"with Tokenizer.save_pretrained"
            )
        eos = _generation_eos_ids(folder / GENERATION_CONFIG)
        light = _light_from_folder(folder)
        if light is not None:
            return cls(extra_eos_ids=eos, light=light)
        from transformers import AutoTokenizer  # here, not at import: transformers imports torch (seconds)

        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:  # only transformers parsing the user's files runs here
            raise PosttrainError(
                f"could not load the tokenizer in {folder}: {err}; check that its tokenizer.json "
                f"and tokenizer_config.json are complete and were written by transformers/tokenizers"
            ) from err
        return cls(hf, eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._light is not None:
            return list(self._light.raw.encode(text, add_special_tokens=add_special_tokens).ids)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def encode_with_offsets(self, text: str):
        """(ids, char_to_token) of `text` with no specials added: char_to_token(i) is the token holding
        character i (None for characters the tokenizer drops)."""
        if self._light is not None:
            enc = self._light.raw.encode(text, add_special_tokens=False)
            return list(enc.ids), enc.char_to_token
        enc = self.hf(text, add_special_tokens=False)
        return list(enc["input_ids"]), enc.char_to_token

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self._light is not None:
            return self._light.raw.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        if self._light is not None:
            return self._light.chat_template
        template = self.hf.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        return template

    def _special_tokens_map(self) -> dict:
        if self._light is not None:
            return dict(self._light.specials)
        return dict(self.hf.special_tokens_map)

    def render_chat(self, messages, add_generation_prompt: bool = False, where: str = "", spans: bool = False,
                    allow_empty: bool = False, template_kwargs: Optional[dict] = None):
        """The chat template's text for `messages` (transformers' rendering, through jinja2 here);
        spans=True: (text, character spans of the {% generation %} blocks). template_kwargs: more template
        variables, as transformers' apply_chat_template(**kwargs) (GPT-OSS `reasoning_effort`, Qwen3
        `enable_thinking`)."""
        at = f"{where}: " if where else ""
        template = self.chat_template
        if template is None:
            name = self._light.name_or_path if self._light is not None else self.hf.name_or_path
            raise PosttrainError(
                f"{at}the tokenizer {name or '(built in memory)'} has no chat template; "
                f"add a chat_template.jinja file to its folder, or use plain-text prompts instead of messages"
            )
        if not messages and not allow_empty:
            raise PosttrainError(f"{at}apply_chat_template got no messages; pass at least one "
                                 "{'role', 'content'} dict")
        try:
            return render(template, list(messages), add_generation_prompt=add_generation_prompt, spans=spans,
                          **{**self._special_tokens_map(), **(template_kwargs or {})})
        except jinja2.TemplateError as err:  # e.g. the template's own raise_exception on bad roles
            raise PosttrainError(
                f"{at}the chat template rejected these messages: {err}; fix the roles/contents of the conversation"
            ) from err

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True,
                            where: str = "", **template_kwargs):
        """Render messages ([{'role': ..., 'content': ...}, ...]); ids if tokenize else the text.

        where: a prefix for error messages (e.g. 'train.jsonl:12'); template_kwargs: more template variables,
        as transformers' (e.g. reasoning_effort="high" for GPT-OSS)."""
        text = self.render_chat(messages, add_generation_prompt, where, template_kwargs=template_kwargs)
        # Tokenized as transformers' apply_chat_template(tokenize=True) does: the template writes the specials.
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def assistant_mask(self, messages, where: str = "") -> tuple[list[int], list[int]]:
        """(ids, mask): mask 1 on the tokens inside the template's {% generation %} blocks, as transformers'
        apply_chat_template(..., return_assistant_tokens_mask=True) marks them."""
        text, spans = self.render_chat(messages, where=where, spans=True)
        ids, char_to_token = self.encode_with_offsets(text)
        mask = [0] * len(ids)
        for start, end in spans:
            first, last = char_to_token(start), char_to_token(end - 1)
            if first is None:
                break
            for t in range(first, last + 1 if last else len(ids)):
                mask[t] = 1
        return ids, mask

    def get_vocab(self) -> dict[str, int]:
        if self._light is not None:
            return self._light.raw.get_vocab(with_added_tokens=True)
        return self.hf.get_vocab()

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too, which is what an embedding table must cover.
        if self._light is not None:
            return self._light.raw.get_vocab_size(with_added_tokens=True)
        return len(self.hf)

    def _special(self, key):
        if self._light is not None:
            return self._light.specials.get(key), self._light.token_id(key)
        return getattr(self.hf, key), getattr(self.hf, f"{key}_id")

    @property
    def bos_id(self) -> int | None:
        return self._special("bos_token")[1]

    @property
    def eos_id(self) -> int | None:
        return self._special("eos_token")[1]

    @property
    def eos_token(self) -> str | None:
        return self._special("eos_token")[0]

    @property
    def pad_id(self) -> int | None:
        # Many base models ship no pad token; padding is masked out anyway, so eos is a safe stand-in.
        pad = self._special("pad_token")[1]
        return pad if pad is not None else self.eos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos first, then extra stop ids, without repeats."""
        ids = ([] if self.eos_id is None else [self.eos_id]) + list(self.extra_eos_ids)
        return tuple(dict.fromkeys(ids))

    def save_pretrained(self, path) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        light = self._light
        if light is not None and light.files:  # loaded from a folder: its files, as they were
            for f in light.files:
                if f.resolve() != (folder / f.name).resolve():
                    shutil.copyfile(f, folder / f.name)
        elif light is not None:  # built in memory: the files transformers writes for a TokenizersBackend
            light.raw.save(str(folder / "tokenizer.json"))
            cfg = {"backend": "tokenizers", **light.specials, "model_max_length": int(1e30),
                   "tokenizer_class": "TokenizersBackend"}
            (folder / "tokenizer_config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2,
                                                                     ensure_ascii=False) + "\n")
            if light.chat_template is not None:
                (folder / "chat_template.jinja").write_text(light.chat_template)
        else:
            self.hf.save_pretrained(str(folder))
        # Extra stop ids live where transformers keeps them, generation_config.json. A model
        # checkpoint may already have written that file; it is the authority, so never overwrite it.
        config = folder / GENERATION_CONFIG
        if self.extra_eos_ids and not config.exists():
            fields = {"bos_token_id": self.bos_id, "eos_token_id": list(self.eos_ids), "pad_token_id": self.pad_id}
            config.write_text(json.dumps({k: v for k, v in fields.items() if v is not None}, indent=2) + "\n")


def _generation_eos_ids(config: Path) -> tuple[int, ...]:
    """eos_token_id from generation_config.json (an int or a list); () when the file is absent."""
    if not config.is_file():
        return ()
    try:
        value = json.loads(config.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as err:
        raise PosttrainError(
            f"{config} is not a JSON object; fix or delete it (it is only read for eos_token_id)"
        ) from err
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise PosttrainError(f"{config}: eos_token_id must be an int or a list of ints, got {value!r}")
    return tuple(values)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet the ByteLevel pre-tokenizer emits."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # whitespace/control bytes map past 255 so every byte gets a visible, distinct char
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def byte_tokenizer() -> Tokenizer:
    """A 263-token tokenizer: 7 specials, then one token per byte. Needs no files."""
    vocab = {token: i for i, token in enumerate(BYTE_SPECIALS)}
    vocab.update({char: BYTE_OFFSET + b for b, char in bytes_to_unicode().items()})
    # BPE with no merges never joins characters, so each byte stays exactly one token.
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the text is mapped byte for byte, spaces included.
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B:1", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    # Registered as special so "<|end|>" in a rendered chat is one token, not 7 bytes.
    raw.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in BYTE_SPECIALS])
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    # A chat reply ends with <|end|>, so sampling must stop there as well as at <eos>.
    return Tokenizer(extra_eos_ids=(vocab["<|end|>"],), light=_Light(raw, specials, BYTE_CHAT_TEMPLATE))


def check_same_tokenizer(ours: Tokenizer, other: Tokenizer, what: str) -> None:
    """Raise unless `other` maps every token to the same id as `ours`, with the same specials.

    `what` starts the message and names the setting at fault (e.g. "model.tokenizer and
    teacher.tokenizer differ", "ppo.critic_path: the tokenizer of X differs from the policy's")."""
    a, b = ours.get_vocab(), other.get_vocab()
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    specials = [(n, x, y) for n, x, y in (("bos", ours.bos_id, other.bos_id), ("eos", ours.eos_id, other.eos_id),
                                          ("pad", ours.pad_id, other.pad_id)) if x != y]
    if diff or specials:
        detail = (f"{len(a)} vs {len(b)} tokens, e.g. {diff[0][0]!r}" if diff else
                  f"{specials[0][0]} id {specials[0][1]} vs {specials[0][2]}")
        raise PosttrainError(f"{what} ({detail}); both models must read the same token ids, so give them "
                             "one tokenizer")

