"""Tests for posttrain.tokenizer. Expected ids are computed from the byte tokenizer's spec
(bos=1, eos=2, <|user|>=3, <|assistant|>=4, <|system|>=5, <|end|>=6, byte b -> 7 + b),
never by calling the code under test."""

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from posttrain.errors import PosttrainError
from posttrain.tokenizer import Tokenizer, byte_tokenizer

PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, END, OFFSET = 0, 1, 2, 3, 4, 5, 6, 7
TEXTS = ["héllo 世界 🙂", "", "  two  spaces\n\ttab", "\x00\x7f\xff", "<b>raw</b>"]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "héllo 🙂"},
    {"role": "assistant", "content": "世界"},
]


def byte_ids(text):
    return [OFFSET + b for b in text.encode("utf-8")]


def expected_chat_ids(messages, add_generation_prompt):
    role_ids = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM}
    ids = [BOS]
    for m in messages:
        ids += [role_ids[m["role"]]] + byte_ids(m["content"]) + [END]
    return ids + ([ASSISTANT] if add_generation_prompt else [])


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_byte_tokenizer_special_ids(tok):
    assert tok.vocab_size == 263
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (PAD, BOS, EOS)
    assert tok.eos_ids == (EOS, END)
    assert tok.hf.convert_ids_to_tokens(list(range(7))) == [
        "<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
    ]


def test_byte_vocab_is_the_byte_level_alphabet(tok):
    byte_tokens = tok.hf.convert_ids_to_tokens(list(range(OFFSET, OFFSET + 256)))
    assert set(byte_tokens) == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip_one_token_per_byte(tok, text):
    ids = tok.encode(text)
    assert ids == [BOS] + byte_ids(text)  # bos only, never eos
    assert tok.encode(text, add_special_tokens=False) == byte_ids(text)
    assert tok.decode(ids) == text


def test_every_byte_value_round_trips_through_decode(tok):
    all_bytes = bytes(range(256)).decode("latin-1")  # 256 chars, but multi-byte in UTF-8
    assert tok.encode(all_bytes, add_special_tokens=False) == byte_ids(all_bytes)
    assert tok.decode([OFFSET + b for b in "✓".encode()]) == "✓"


def test_decode_keeps_specials_when_asked(tok):
    assert tok.decode([BOS, USER, OFFSET + ord("a"), END], skip_special_tokens=False) == "<bos><|user|>a<|end|>"
    assert tok.decode([BOS, USER, OFFSET + ord("a"), END]) == "a"


def test_special_token_text_is_one_token(tok):
    assert tok.encode("<|end|>x", add_special_tokens=False) == [END, OFFSET + ord("x")]


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_ids(tok, add_generation_prompt):
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    assert isinstance(ids, list)
    assert ids == expected_chat_ids(CHAT, add_generation_prompt)


def test_chat_template_text(tok):
    text = tok.apply_chat_template(CHAT[:2], add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|system|>Be brief.<|end|><|user|>héllo 🙂<|end|><|assistant|>"


def test_assistant_mask_covers_reply_and_end(tok):
    out = tok.hf.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
    expected = expected_chat_ids(CHAT, False)
    assert out["input_ids"] == expected
    reply = len(byte_ids(CHAT[2]["content"])) + 1  # the reply's bytes and its <|end|>
    assert out["assistant_masks"] == [0] * (len(expected) - reply) + [1] * reply


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    loaded = Tokenizer.from_pretrained(tmp_path / "tok")
    for text in TEXTS:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    for gen in (False, True):
        assert loaded.apply_chat_template(CHAT, add_generation_prompt=gen) == expected_chat_ids(CHAT, gen)
        text = tok.apply_chat_template(CHAT, gen, tokenize=False)
        assert loaded.apply_chat_template(CHAT, gen, tokenize=False) == text
    assert loaded.hf.chat_template == tok.hf.chat_template
    assert (loaded.vocab_size, loaded.bos_id, loaded.pad_id, loaded.eos_ids) == (263, BOS, PAD, (EOS, END))


def test_save_keeps_an_existing_generation_config(tok, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    tok.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": 2}
    assert Tokenizer.from_pretrained(tmp_path).eos_ids == (EOS,)


def word_level_folder(path, generation_config=None):
    """A tiny WordLevel tokenizer with an extra stop token and no chat template or pad token."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "<|eot|>": 5}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>")
    hf.save_pretrained(str(path))
    if generation_config is not None:
        (path / "generation_config.json").write_text(generation_config)
    return path


def test_generation_config_eos_list(tmp_path):
    tok = Tokenizer.from_pretrained(word_level_folder(tmp_path, json.dumps({"eos_token_id": [2, 5]})))
    assert tok.eos_ids == (2, 5)
    assert tok.eos_id == 2
    assert tok.pad_id == 2  # no pad token: falls back to eos
    assert tok.bos_id is None
    assert tok.encode("a b zz") == [3, 4, 0]


def test_generation_config_single_eos(tmp_path):
    tok = Tokenizer.from_pretrained(word_level_folder(tmp_path, json.dumps({"eos_token_id": 5})))
    assert tok.eos_ids == (2, 5)


def test_bad_generation_config(tmp_path):
    folder = word_level_folder(tmp_path, json.dumps({"eos_token_id": "five"}))
    with pytest.raises(PosttrainError, match="eos_token_id"):
        Tokenizer.from_pretrained(folder)
    (folder / "generation_config.json").write_text("{not json")
    with pytest.raises(PosttrainError, match="generation_config.json"):
        Tokenizer.from_pretrained(folder)


def test_no_chat_template_raises(tmp_path):
    tok = Tokenizer.from_pretrained(word_level_folder(tmp_path))
    with pytest.raises(PosttrainError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_missing_folder_raises(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(PosttrainError) as info:
        Tokenizer.from_pretrained(missing)
    assert str(missing) in str(info.value)


def test_folder_without_tokenizer_files_raises(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(PosttrainError) as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert "tokenizer.json" in str(info.value)


def test_corrupt_tokenizer_json_raises(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(PosttrainError) as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_template_errors_and_empty_messages_raise():
    tok = byte_tokenizer()
    with pytest.raises(PosttrainError, match="no messages"):
        tok.apply_chat_template([])
    tok.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(PosttrainError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


@pytest.mark.parametrize("folder", ["byte", "word_level"])
def test_light_tokenizer_matches_transformers(tok, tmp_path, folder):
    """A folder loaded without transformers encodes, decodes, renders and masks exactly as transformers does."""
    from transformers import AutoTokenizer

    if folder == "byte":
        tok.save_pretrained(tmp_path)
    else:
        word_level_folder(tmp_path)
    ours, theirs = Tokenizer.from_pretrained(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours._light is not None  # loaded without transformers
    texts = TEXTS + ["<|end|>x <eos>", "a b zz"]
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, special) == theirs.encode(text, add_special_tokens=special)
        ids = theirs.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.eos_token, ours.get_vocab()) == \
        (len(theirs), theirs.bos_token_id, theirs.eos_token_id, theirs.eos_token, theirs.get_vocab())
    if folder == "byte":
        for gen in (False, True):
            assert ours.apply_chat_template(CHAT, gen, tokenize=False) == \
                theirs.apply_chat_template(CHAT, add_generation_prompt=gen, tokenize=False)
        out = theirs.apply_chat_template(CHAT, return_dict=True, return_assistant_tokens_mask=True)
        assert ours.assistant_mask(CHAT) == (list(out["input_ids"]), list(out["assistant_masks"]))


def test_template_variables_render_as_transformers(tmp_path):
    """Template variables beyond the messages (GPT-OSS's reasoning_effort, with its default when not given)
    render as transformers' apply_chat_template(**kwargs) renders them, text and ids."""
    path = word_level_folder(tmp_path)
    template = ("{{ '<s>' }}{% if reasoning_effort is defined %}{{ reasoning_effort + ' ' }}{% else %}{{ 'a ' }}"
                "{% endif %}{% for m in messages %}{{ m['content'] + ' </s> ' }}{% endfor %}")
    (path / "chat_template.jinja").write_text(template)
    hf = PreTrainedTokenizerFast.from_pretrained(str(path))
    ours = Tokenizer.from_pretrained(str(path))
    msgs = [{"role": "user", "content": "a b"}]
    for kw in ({}, {"reasoning_effort": "b"}):
        assert ours.apply_chat_template(msgs, tokenize=False, **kw) == hf.apply_chat_template(msgs, tokenize=False,
                                                                                              **kw)
        assert ours.apply_chat_template(msgs, **kw) == hf.apply_chat_template(msgs, return_dict=False, **kw)
    assert ours.apply_chat_template(msgs, tokenize=False, reasoning_effort="b").startswith("<s>b ")


def test_gpt_oss_chat_template_renders_as_transformers(tmp_path):
    """GPT-OSS's own chat template (the copy TRL ships, trl/chat_templates/gptoss.jinja: harmony channels, the
    `reasoning_effort` system line, developer instructions, tools, a tool call and its result, the final
    assistant turn's thinking) renders as transformers renders it, text and ids."""
    import trl

    template = Path(trl.__file__).parent / "chat_templates" / "gptoss.jinja"
    path = word_level_folder(tmp_path)
    (path / "chat_template.jinja").write_text(template.read_text())
    hf = PreTrainedTokenizerFast.from_pretrained(str(path))
    ours = Tokenizer.from_pretrained(str(path))
    tools = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a"]}}}]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"},
            {"role": "assistant", "content": "b a", "thinking": "a then b"}, {"role": "user", "content": "b"}]
    for kw in ({}, {"reasoning_effort": "high"}, {"reasoning_effort": "low", "add_generation_prompt": True},
               {"tools": tools, "add_generation_prompt": True}):
        text = ours.apply_chat_template(msgs, tokenize=False, **kw)
        assert text == hf.apply_chat_template(msgs, tokenize=False, **kw), kw
        assert ours.apply_chat_template(msgs, **kw) == hf.apply_chat_template(msgs, return_dict=False, **kw)
        assert f"Reasoning: {kw.get('reasoning_effort', 'medium')}" in text
    assert "namespace functions {" in text and "type add = " in text and text.endswith("<|start|>assistant")
    # a tool call and its result, then a final answer whose thinking renders (the last assistant turn's only)
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    msgs = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "b a", "thinking": "a then b"}]
    text = ours.apply_chat_template(msgs, tokenize=False, tools=tools)
    assert text == hf.apply_chat_template(msgs, tokenize=False, tools=tools)
    assert ours.apply_chat_template(msgs, tools=tools) == hf.apply_chat_template(msgs, return_dict=False, tools=tools)
    for part in ("to=functions.add", '{"a": 1, "b": 2}<|call|>', "<|channel|>analysis<|message|>a then b",
                 "<|channel|>final<|message|>b a<|return|>"):
        assert part in text, part
