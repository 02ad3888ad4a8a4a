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
from pathlib import Path

import jinja2
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as RawTokenizer

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


class Tokenizer:
    """Wraps a transformers fast tokenizer; `extra_eos_ids` are further ids that end generation."""

    def __init__(self, hf, extra_eos_ids=()):
        self.hf = hf
        self.extra_eos_ids = tuple(int(i) for i in extra_eos_ids)

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
        from transformers import AutoTokenizer  # here, not at import: transformers imports torch (seconds)

        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as err:  # only transformers parsing the user's files runs here
            raise PosttrainError(
                f"could not load the tokenizer in {folder}: {err}; check that its tokenizer.json "
                f"and tokenizer_config.json are complete and were written by transformers/tokenizers"
            ) from err
        return cls(hf, _generation_eos_ids(folder / GENERATION_CONFIG))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False, tokenize: bool = True,
                            where: str = ""):
        """Render messages ([{'role': ..., 'content': ...}, ...]); ids if tokenize else the text.

        where: a prefix for error messages (e.g. 'train.jsonl:12')."""
        at = f"{where}: " if where else ""
        if self.hf.chat_template is None:
            raise PosttrainError(
                f"{at}the tokenizer {self.hf.name_or_path or '(built in memory)'} has no chat template; "
                f"add a chat_template.jinja file to its folder, or use plain-text prompts instead of messages"
            )
        if not messages:
            raise PosttrainError(f"{at}apply_chat_template got no messages; pass at least one "
                                 "{'role', 'content'} dict")
        try:
            out = self.hf.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=False
            )
        except jinja2.TemplateError as err:  # e.g. the template's own raise_exception on bad roles
            raise PosttrainError(
                f"{at}the chat template rejected these messages: {err}; fix the roles/contents of the conversation"
            ) from err
        return list(out) if tokenize else out

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens too, which is what an embedding table must cover.
        return len(self.hf)

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def pad_id(self) -> int | None:
        # Many base models ship no pad token; padding is masked out anyway, so eos is a safe stand-in.
        return self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: eos first, then extra stop ids, without repeats."""
        ids = ([] if self.eos_id is None else [self.eos_id]) + list(self.extra_eos_ids)
        return tuple(dict.fromkeys(ids))

    def save_pretrained(self, path) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
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


def _bytes_to_unicode() -> dict[int, str]:
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
    vocab.update({char: BYTE_OFFSET + b for b, char in _bytes_to_unicode().items()})
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
    from transformers import PreTrainedTokenizerFast  # here, not at import: transformers imports torch

    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        chat_template=BYTE_CHAT_TEMPLATE,
    )
    # A chat reply ends with <|end|>, so sampling must stop there as well as at <eos>.
    return Tokenizer(hf, extra_eos_ids=(vocab["<|end|>"],))


def check_same_tokenizer(ours: Tokenizer, other: Tokenizer, what: str) -> None:
    """Raise unless `other` maps every token to the same id as `ours`, with the same specials.

    `what` starts the message and names the setting at fault (e.g. "model.tokenizer and
    teacher.tokenizer differ", "ppo.critic_path: the tokenizer of X differs from the policy's")."""
    a, b = ours.hf.get_vocab(), other.hf.get_vocab()
    diff = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    specials = [(n, x, y) for n, x, y in (("bos", ours.bos_id, other.bos_id), ("eos", ours.eos_id, other.eos_id),
                                          ("pad", ours.pad_id, other.pad_id)) if x != y]
    if diff or specials:
        detail = (f"{len(a)} vs {len(b)} tokens, e.g. {diff[0][0]!r}" if diff else
                  f"{specials[0][0]} id {specials[0][1]} vs {specials[0][2]}")
        raise PosttrainError(f"{what} ({detail}); both models must read the same token ids, so give them "
                             "one tokenizer")

