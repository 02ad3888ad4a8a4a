"""Row formats: turn one dataset row into token ids and a loss mask.

What it is: `tokenize_row(row, where, tok)` accepts the four TRL SFT dataset formats unchanged
(https://huggingface.co/docs/trl/dataset_formats), plus masked segments, and returns `(ids, loss_mask)`
of equal length, loss_mask[i] = 1 when token i is a training target:
  - "text":        {"text": str}                      ids = encode(text) + [eos]; loss on all
  - "prompt_completion": {"prompt": str, "completion": str}
                   ids = encode(prompt) + encode(completion, no specials) + [eos];
                   loss on completion + eos (all tokens if completion_only_loss=False)
  - "messages":    {"messages": [{"role", "content"}, ...]}   ids from the chat template;
                   loss on assistant tokens (all tokens if assistant_only_loss=False)
  - "conversational_prompt_completion": {"prompt": [messages], "completion": [messages]}
                   ids from the chat template of prompt + completion; loss on the completion
                   (completion_only_loss) and on assistant tokens (assistant_only_loss), both
                   when both are set, as TRL does.
  - "segments":    {"segments": [{"text": str, "label": bool}, ...]}   (the shape of axolotl's template-free
                   `input_output` rows) ids = encode(segments[0].text) + encode(each later text, no specials)
                   + [eos]; loss exactly on the `"label": true` segments + eos. For text the model must learn
                   with text it must not, in any order: an agent's episode (its calls and answer trained, the
                   prompt and the tool outputs not). completion_only_loss / assistant_only_loss do not apply
                   (the labels are the mask); a row with no labelled token is an error.
                   `encode_segments(segments, encode)` is the same over [(text, trainable)] pairs.
No eos is appended to chat formats: the template already ends each turn with its own end token.
Assistant tokens come from the template's `{% generation %}` markers when it has them
(transformers' return_assistant_tokens_mask); otherwise the conversation is rendered
incrementally: for each assistant message i, the text between render(messages[:i],
add_generation_prompt=True) and render(messages[:i+1]) is assistant text. Both mark the same
tokens for a template where both work.

What it is not: no file reading (`sources.py`), no truncation, padding or packing
(`pipeline.py`), and no preference/RL formats (chosen/rejected) yet.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

from posttrain.errors import PosttrainError

FORMATS = ("text", "prompt_completion", "messages", "conversational_prompt_completion", "segments")
ACCEPTED = (
    '{"text": str}, {"prompt": str, "completion": str}, {"messages": [{"role": ..., "content": ...}, ...]}, '
    '{"prompt": [messages], "completion": [messages]}, or {"segments": [{"text": str, "label": bool}, ...]}'
)
# The same test transformers applies before honouring return_assistant_tokens_mask.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def detect_format(row: dict, where: str = "row") -> str:
    """Which of FORMATS `row` is. Priority when several fields exist: segments, messages, prompt/completion,
    text."""
    if not isinstance(row, dict):
        raise PosttrainError(
            f"{where}: a row must be an object (dict), got {type(row).__name__}; rows must be {ACCEPTED}"
        )
    if "segments" in row:
        return "segments"
    if "messages" in row:
        return "messages"
    if "prompt" in row or "completion" in row:
        for present, missing in (("prompt", "completion"), ("completion", "prompt")):
            if missing not in row:
                raise PosttrainError(
                    f"{where}: the row has a '{present}' field but no '{missing}' field; prompt/completion "
                    f'rows need both (or use {{"text": ...}} to train on every token)'
                )
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return "prompt_completion"
        if isinstance(prompt, list) and isinstance(completion, list):
            return "conversational_prompt_completion"
        raise PosttrainError(
            f"{where}: field 'prompt' is {_kind(prompt)} and field 'completion' is {_kind(completion)}; "
            f"both must be strings, or both lists of {{'role', 'content'}} messages"
        )
    if "text" in row:
        return "text"
    raise PosttrainError(
        f"{where}: no recognised field (the row has {sorted(row)}); each row must be {ACCEPTED}"
    )


def tokenize_row(
    row: dict,
    where: str,
    tok,
    *,
    completion_only_loss: bool = True,
    assistant_only_loss: bool = True,
    add_eos: bool = True,
) -> tuple[list[int], list[int]]:
    """(ids, loss_mask) for one row; every problem raises PosttrainError naming `where` and the field."""
    fmt = detect_format(row, where)
    if fmt == "segments":
        return _segments(row, where, tok, add_eos)
    if fmt == "text":
        text = _string(row, "text", where)
        ids = _with_eos(tok.encode(text), tok, add_eos, where)
        return ids, [1] * len(ids)
    if fmt == "prompt_completion":
        prompt_ids = tok.encode(_string(row, "prompt", where, allow_empty=True))
        completion_ids = _with_eos(
            tok.encode(_string(row, "completion", where), add_special_tokens=False), tok, add_eos, where
        )
        prompt_mask = 0 if completion_only_loss else 1
        return prompt_ids + completion_ids, [prompt_mask] * len(prompt_ids) + [1] * len(completion_ids)
    if fmt == "messages":
        msgs = messages(row, "messages", where)
        return _conversation(tok, msgs, where, prompt=None, assistant_only_loss=assistant_only_loss)
    prompt, completion = messages(row, "prompt", where), messages(row, "completion", where)
    return _conversation(
        tok,
        prompt + completion,
        where,
        prompt=prompt if completion_only_loss else None,
        assistant_only_loss=assistant_only_loss,
    )


def encode_segments(
    segments: Sequence[tuple[str, bool]], encode: Callable[[str], list[int]]
) -> tuple[list[int], list[int]]:
    """(ids, mask) of the concatenated segments: `encode(text)` per segment (no special tokens; for a
    Tokenizer pass `lambda s: tok.encode(s, add_special_tokens=False)`), mask 1 on trainable tokens."""
    ids: list[int] = []
    mask: list[int] = []
    for text, trainable in segments:
        piece = list(encode(text))
        ids += piece
        mask += [int(bool(trainable))] * len(piece)
    return ids, mask


def _segments(row: dict, where: str, tok, add_eos: bool) -> tuple[list[int], list[int]]:
    """A "segments" row: the first text as `tok.encode` gives it (BOS), the others without specials, then eos."""
    segs = row["segments"]
    if not isinstance(segs, list) or not segs:
        raise PosttrainError(
            f"{where}: field 'segments' must be a non-empty list of {{\"text\": str, \"label\": bool}} objects, "
            f"got {'an empty list' if isinstance(segs, list) else _kind(segs)}"
        )
    for i, s in enumerate(segs):
        if not isinstance(s, dict):
            raise PosttrainError(
                f"{where}: segments[{i}] must be an object {{\"text\": str, \"label\": bool}}, got {_kind(s)}"
            )
        if not isinstance(s.get("text"), str):
            raise PosttrainError(f"{where}: segments[{i}] has no 'text' string (got {_kind(s.get('text'))}); add "
                                 f'the segment\'s text, e.g. "text": "..."')
        if not isinstance(s.get("label"), bool):
            raise PosttrainError(f"{where}: segments[{i}].label must be true (train on this text) or false (do not), "
                                 f"got {_kind(s.get('label'))}")
    first = tok.encode(segs[0]["text"])
    rest_ids, rest_mask = encode_segments([(s["text"], s["label"]) for s in segs[1:]],
                                          lambda text: tok.encode(text, add_special_tokens=False))
    ids, mask = first + rest_ids, [int(segs[0]["label"])] * len(first) + rest_mask
    if not any(mask[1:]):  # token 0 is never a target
        raise PosttrainError(
            f'{where}: no segment with "label": true has text, so the row has nothing to train on; label the '
            f"text the model should learn true (or remove the row)"
        )
    full = _with_eos(ids, tok, add_eos, where)
    return full, mask + [1] * (len(full) - len(ids))


def _kind(value) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def _string(row: dict, field: str, where: str, allow_empty: bool = False) -> str:
    value = row[field]
    if not isinstance(value, str):
        raise PosttrainError(f"{where}: field '{field}' must be a string, got {_kind(value)}")
    if not value and not allow_empty:
        raise PosttrainError(
            f"{where}: field '{field}' is empty; remove the row or fill it in (there is nothing to train on)"
        )
    return value


def _with_eos(ids: list[int], tok, add_eos: bool, where: str) -> list[int]:
    if not add_eos:
        return ids
    if tok.eos_id is None:
        raise PosttrainError(f"{where}: add_eos is set but the tokenizer has no eos token; set add_eos=False")
    # Some tokenizers' post-processors already append eos; a second one would teach "eos eos".
    return ids if ids and ids[-1] == tok.eos_id else ids + [tok.eos_id]


def messages(row: dict, field: str, where: str) -> list[dict]:
    """`row[field]` checked as a list of {"role", "content"} messages; a PosttrainError naming `where` if not."""
    msgs = row[field]
    if not isinstance(msgs, list):
        raise PosttrainError(
            f"{where}: field '{field}' must be a list of {{'role', 'content'}} messages, got {_kind(msgs)}"
        )
    if not msgs:
        raise PosttrainError(
            f"{where}: field '{field}' is an empty list of messages; remove the row or fill it in"
        )
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise PosttrainError(
                f"{where}: {field}[{i}] must be an object with 'role' and 'content', got {_kind(m)}"
            )
        if not isinstance(m.get("role"), str):
            raise PosttrainError(
                f'{where}: {field}[{i}] has no \'role\' string (got {_kind(m.get("role"))}); add e.g. "role": "user"'
            )
        content = m.get("content")
        # Assistant tool calls legitimately carry no content; Arrow sources fill absent keys with None.
        if content is None and not m.get("tool_calls"):
            raise PosttrainError(
                f"{where}: {field}[{i}] (role {m['role']!r}) has no 'content'; add the message text"
            )
        if content is not None and not isinstance(content, (str, list)):
            raise PosttrainError(
                f"{where}: {field}[{i}].content must be a string (or a list of parts), got {_kind(content)}"
            )
    return msgs


def _render(tok, messages: list[dict], where: str, add_generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, where=where)


def _render_empty(tok, where: str) -> str:
    """What the template writes before a first assistant reply: render([], add_generation_prompt=True)."""
    try:
        # transformers rejects an empty conversation but not an empty one inside a batch of one.
        return tok.render_chat([], add_generation_prompt=True, allow_empty=True)
    except Exception as err:  # the user's template may index messages[0]; any failure means "cannot"
        raise PosttrainError(
            f"{where}: the conversation starts with an assistant message and the chat template cannot render "
            f"an empty conversation ({err}) to find where that reply begins; add {{% generation %}}..."
            f"{{% endgeneration %}} around assistant replies in the template, or start with a user message"
        ) from err


def _conversation(tok, messages, where, *, prompt, assistant_only_loss) -> tuple[list[int], list[int]]:
    """Render `messages` (prompt + completion when `prompt` is given); mask = completion AND assistant."""
    text = _render(tok, messages, where, add_generation_prompt=False)
    # Tokenized exactly as apply_chat_template(tokenize=True) does: the template writes the specials.
    ids, enc = tok.encode_with_offsets(text)  # enc(c): the token holding character c
    mask = [1] * len(ids)
    if prompt is not None:
        prompt_text = _render(tok, prompt, where, add_generation_prompt=True)
        _check_prefix(text, prompt_text, where, "the prompt (with the generation prompt)")
        mask = _span_mask(enc, len(ids), [(len(prompt_text), len(text))])
        if not any(mask):
            raise PosttrainError(
                f"{where}: the completion renders to no tokens; check field 'completion' is not blank"
            )
    if assistant_only_loss:
        if not any(m["role"] == "assistant" for m in messages):
            raise PosttrainError(
                f"{where}: the conversation has no assistant message, so assistant_only_loss leaves nothing "
                f"to train on; add an assistant reply or set assistant_only_loss=False"
            )
        assistant = _assistant_mask(tok, messages, where, text, enc, ids)
        mask = [a & b for a, b in zip(mask, assistant)]
        if not any(mask):
            raise PosttrainError(
                f"{where}: no token is both an assistant token and (for prompt/completion rows) part of the "
                f"completion; put the assistant reply in the completion, or set assistant_only_loss=False"
            )
    return ids, mask


def _assistant_mask(tok, messages, where, text, enc, ids) -> list[int]:
    template = tok.chat_template
    if _GENERATION_TAG.search(template):
        out_ids, out_mask = tok.assistant_mask(messages, where)
        if out_ids != ids:
            # Only a template that renders differently each call (e.g. today's date) gets here.
            raise PosttrainError(
                f"{where}: the chat template rendered this conversation differently twice; it must be deterministic"
            )
        return out_mask
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        # The reply starts where the generation prompt for it ends and ends where the turn ends.
        before = (
            _render(tok, messages[:i], where, add_generation_prompt=True) if i else _render_empty(tok, where)
        )
        upto = _render(tok, messages[: i + 1], where, add_generation_prompt=False)
        _check_prefix(text, before, where, f"messages[:{i}] (with the generation prompt)")
        _check_prefix(text, upto, where, f"messages[:{i + 1}]")
        spans.append((len(before), len(upto)))
    return _span_mask(enc, len(ids), spans)


def _check_prefix(text: str, prefix: str, where: str, what: str) -> None:
    if not text.startswith(prefix):
        raise PosttrainError(
            f"{where}: the chat template renders {what} as text that is not a prefix of the whole "
            f"conversation (it rewrites earlier turns, e.g. drops reasoning), so the trained tokens cannot be "
            f"located; add {{% generation %}}...{{% endgeneration %}} around assistant replies in the template, "
            f"or set assistant_only_loss=False / completion_only_loss=False"
        )


def _span_mask(enc, n: int, spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a character span [start, end) of the rendered text."""
    mask = [0] * n
    for start, end in spans:
        # Characters a tokenizer drops (e.g. stripped spaces) map to no token: look past them.
        # Scanning in from each end keeps this to a few calls per span, not one per character.
        first = next((t for c in range(start, end) if (t := enc(c)) is not None), None)
        if first is None:
            continue
        last = next(t for c in range(end - 1, start - 1, -1) if (t := enc(c)) is not None)
        for t in range(first, last + 1):
            mask[t] = 1
    return mask
