"""Tests for posttrain.data. Expected ids come from the byte tokenizer's spec (bos=1, eos=2,
<|user|>=3, <|assistant|>=4, <|system|>=5, <|end|>=6, byte b -> 7 + b) and expected arrays from
the field conventions in pipeline.py, never from the code under test."""

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from posttrain.data import (
    Example,
    batches,
    detect_format,
    load_examples,
    read_rows,
    to_arrays,
    tokenize_row,
)
from posttrain.errors import PosttrainError
from posttrain.tokenizer import BYTE_CHAT_TEMPLATE, byte_tokenizer

DATA = Path(__file__).parent / "data"
PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, END = 0, 1, 2, 3, 4, 5, 6
ROLE = {"user": USER, "assistant": ASSISTANT, "system": SYSTEM}


def b(text):
    return [7 + x for x in text.encode("utf-8")]


def chat(messages):
    """Expected (ids, assistant mask): the assistant's content and its <|end|> are trained."""
    ids, mask = [BOS], [0]
    for m in messages:
        body = b(m["content"]) + [END]
        ids += [ROLE[m["role"]]] + body
        mask += [0] + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def msg(role, content):
    return {"role": role, "content": content}


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def tok_no_markers():
    t = byte_tokenizer()
    t.hf.chat_template = BYTE_CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert "generation %" not in t.hf.chat_template
    return t


# ---------------------------------------------------------------- sources


def test_read_rows_jsonl_where_is_file_and_line_and_blank_lines_skipped():
    path = DATA / "sft_text.jsonl"
    rows = list(read_rows(path))
    assert [w for _, w in rows] == [f"{path}:1", f"{path}:2", f"{path}:4"]
    assert rows[1][0] == {"text": "ok!", "source": "extra columns are ignored"}


def test_read_rows_errors(tmp_path):
    with pytest.raises(PosttrainError, match="nope.jsonl does not exist"):
        list(read_rows(tmp_path / "nope.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "a"}, '{"text": "b",', {"text": "c"}])
    with pytest.raises(PosttrainError, match=r"bad\.jsonl:2: the line is not valid JSON"):
        list(read_rows(bad))
    arr = write_jsonl(tmp_path / "arr.jsonl", [{"text": "a"}, "[1, 2]"])
    with pytest.raises(PosttrainError, match=r"arr\.jsonl:2: .*not an object"):
        list(read_rows(arr))
    with pytest.raises(PosttrainError, match="unknown extension '.csv'"):
        list(read_rows(write_jsonl(tmp_path / "x.csv", ["a,b"])))


def test_parquet_and_save_to_disk_sources(tmp_path, tok):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (DATA / "sft_messages.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet", row_group_size=1)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "m.parquet", tmp_path / "saved"):
        got = list(read_rows(path))
        assert [w for _, w in got] == [f"{path}:row 0", f"{path}:row 1"]
        # Arrow unifies struct fields, so compare the fields the formats read.
        assert [[(m["role"], m["content"]) for m in r["messages"]] for r, _ in got] == [
            [(m["role"], m["content"]) for m in r["messages"]] for r in rows
        ]
        examples, counts = load_examples(path, tok, max_length=64)
        assert [e.ids.tolist() for e in examples] == [chat(r["messages"])[0] for r in rows]
        assert counts == {"rows": 2, "skipped": 0, "truncated": 0, "dropped": 0}
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(PosttrainError, match=r"DatasetDict with splits \['train'\]"):
        list(read_rows(tmp_path / "dd"))


# ---------------------------------------------------------------- formats


def test_text_format(tok):
    assert detect_format({"text": "hi"}) == "text"
    assert tokenize_row({"text": "hi", "x": 1}, "f:1", tok) == ([BOS, *b("hi"), EOS], [1] * 4)
    assert tokenize_row({"text": "hi"}, "f:1", tok, add_eos=False) == ([BOS, *b("hi")], [1] * 3)


def test_prompt_completion_format(tok):
    row = {"prompt": "Q:", "completion": "A"}
    assert detect_format(row) == "prompt_completion"
    ids = [BOS, *b("Q:"), *b("A"), EOS]
    assert tokenize_row(row, "f:1", tok) == (ids, [0, 0, 0, 1, 1])
    assert tokenize_row(row, "f:1", tok, completion_only_loss=False) == (ids, [1] * 5)
    assert tokenize_row({"prompt": "", "completion": "A"}, "f:1", tok) == ([BOS, *b("A"), EOS], [0, 1, 1])


CONVERSATIONS = [
    [msg("user", "hi"), msg("assistant", "yo")],
    [msg("system", "s"), msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "dé")],
    [msg("assistant", "hello"), msg("user", "q")],  # starts with the assistant, ends with a user turn
    [msg("user", "x"), msg("assistant", "")],  # an empty reply still trains its <|end|>
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_messages_assistant_mask_markers_and_incremental_agree(tok, tok_no_markers, messages):
    expected = chat(messages)
    assert detect_format({"messages": messages}) == "messages"
    assert tokenize_row({"messages": messages}, "f:1", tok) == expected
    assert tokenize_row({"messages": messages}, "f:1", tok_no_markers) == expected
    ids, _ = expected
    assert tokenize_row({"messages": messages}, "f:1", tok, assistant_only_loss=False) == (
        ids,
        [1] * len(ids),
    )


def test_conversational_prompt_completion(tok, tok_no_markers):
    prompt = [msg("user", "a"), msg("assistant", "b"), msg("user", "c")]
    completion = [msg("assistant", "d")]
    row = {"prompt": prompt, "completion": completion}
    assert detect_format(row) == "conversational_prompt_completion"
    ids, assistant = chat(prompt + completion)
    only_d = [0] * (len(ids) - 2) + [1, 1]  # "d" and its <|end|>
    for t in (tok, tok_no_markers):
        assert tokenize_row(row, "f:1", t) == (ids, only_d)
        assert tokenize_row(row, "f:1", t, assistant_only_loss=False) == (ids, only_d)
        assert tokenize_row(row, "f:1", t, completion_only_loss=False) == (ids, assistant)
        assert tokenize_row(row, "f:1", t, completion_only_loss=False, assistant_only_loss=False) == (
            ids,
            [1] * len(ids),
        )


@pytest.mark.parametrize(
    "row, pattern",
    [
        ({"input": "x", "output": "y"}, r"w\.jsonl:3: no recognised field .*'input', 'output'.*\"text\""),
        ({"text": 5}, r"w\.jsonl:3: field 'text' must be a string, got a int"),
        ({"text": ""}, r"w\.jsonl:3: field 'text' is empty"),
        ({"prompt": "p"}, r"w\.jsonl:3: .*'prompt' field but no 'completion'"),
        ({"prompt": "p", "completion": ""}, r"w\.jsonl:3: field 'completion' is empty"),
        (
            {"prompt": "p", "completion": None},
            r"w\.jsonl:3: field 'prompt' is a str and field 'completion' is null",
        ),
        (
            {"prompt": [msg("user", "p")], "completion": []},
            r"w\.jsonl:3: field 'completion' is an empty list",
        ),
        ({"messages": "hi"}, r"w\.jsonl:3: field 'messages' must be a list"),
        ({"messages": [msg("user", "hi")]}, r"w\.jsonl:3: .*no assistant message.*assistant_only_loss=False"),
        ({"messages": [{"content": "hi"}]}, r"w\.jsonl:3: messages\[0\] has no 'role'"),
        ({"messages": [{"role": "user"}]}, r"w\.jsonl:3: messages\[0\] \(role 'user'\) has no 'content'"),
        ({"messages": [msg("user", 3)]}, r"w\.jsonl:3: messages\[0\]\.content must be a string"),
    ],
)
def test_row_errors_name_where_and_field(tok, row, pattern):
    with pytest.raises(PosttrainError, match=pattern):
        tokenize_row(row, "w.jsonl:3", tok)


def test_user_only_conversation_is_fine_without_assistant_only_loss(tok):
    messages = [msg("user", "hi")]
    ids, _ = chat(messages)
    assert tokenize_row({"messages": messages}, "f:1", tok, assistant_only_loss=False) == (
        ids,
        [1] * len(ids),
    )


def seg(text, label):
    return {"text": text, "label": label}


def test_segments_format_masks_exactly_the_labelled_text(tok):
    # An agent's episode: prompt (no), call (yes), tool output (no), answer (yes); then eos (yes).
    row = {"segments": [seg("Q?", False), seg("<c>", True), seg("42", False), seg("A", True)], "prompt": "x"}
    assert detect_format(row) == "segments"  # segments win over any other column
    ids = [BOS, *b("Q?"), *b("<c>"), *b("42"), *b("A"), EOS]
    mask = [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert tokenize_row(row, "f:1", tok) == (ids, mask)
    # the labels are the mask: completion_only_loss / assistant_only_loss change nothing
    assert tokenize_row(row, "f:1", tok, completion_only_loss=False, assistant_only_loss=False) == (ids, mask)
    assert tokenize_row(row, "f:1", tok, add_eos=False) == (ids[:-1], mask[:-1])
    # a labelled first segment: its BOS is labelled too (never a target: position 0 predicts it from nothing)
    assert tokenize_row({"segments": [seg("hi", True)]}, "f:1", tok) == ([BOS, *b("hi"), EOS], [1, 1, 1, 1])
    # empty texts add no tokens; an empty first segment still gives the BOS
    row = {"segments": [seg("", False), seg("", True), seg("y", True)]}
    assert tokenize_row(row, "f:1", tok) == ([BOS, *b("y"), EOS], [0, 1, 1])


def test_segments_rows_load_and_pack_one_episode_a_segment(tmp_path, tok):
    rows = [{"segments": [seg("ab", False), seg("c", True), seg("de", False), seg("f", True)]},
            {"segments": [seg("g", False), seg("h", True)]}]
    examples, counts = load_examples(write_jsonl(tmp_path / "e.jsonl", rows), tok, max_length=16)
    assert counts == {"rows": 2, "skipped": 0, "truncated": 0, "dropped": 0}
    assert examples[0].ids.tolist() == [BOS, *b("abcdef"), EOS] and examples[0].loss_mask.tolist() == [
        0, 0, 0, 1, 0, 0, 1, 1]
    packed = to_arrays(examples, 16, PAD, True)
    first = [BOS, *b("abcdef"), EOS]
    second = [BOS, *b("gh"), EOS]
    assert packed["tokens"].tolist() == [first + second + [PAD] * 4]
    assert packed["segment_ids"].tolist() == [[1] * 8 + [2] * 4 + [0] * 4]
    assert packed["positions"].tolist() == [list(range(8)) + list(range(4)) + [0] * 4]
    # position t is weighted by the label of token t + 1 of its own episode; nothing crosses episodes
    assert packed["weights"].tolist() == [[0, 0, 1, 0, 0, 1, 1, 0] + [0, 1, 1, 0] + [0] * 4]
    assert packed["targets"].tolist() == [first[1:] + [0] + second[1:] + [0] + [0] * 4]


@pytest.mark.parametrize(
    "row, pattern",
    [
        ({"segments": "hi"}, r"w\.jsonl:3: field 'segments' must be a non-empty list .*got a str"),
        ({"segments": []}, r"w\.jsonl:3: field 'segments' must be a non-empty list .*got an empty list"),
        ({"segments": [seg("a", True), "b"]}, r"w\.jsonl:3: segments\[1\] must be an object .*got a str"),
        ({"segments": [{"label": True}]}, r"w\.jsonl:3: segments\[0\] has no 'text' string \(got null\)"),
        ({"segments": [seg(7, True)]}, r"w\.jsonl:3: segments\[0\] has no 'text' string \(got a int\)"),
        ({"segments": [seg("a", False), {"text": "b"}]}, r"w\.jsonl:3: segments\[1\]\.label must be true .*got null"),
        ({"segments": [seg("a", "true")]}, r"w\.jsonl:3: segments\[0\]\.label must be true .*got a str"),
        ({"segments": [seg("a", 1)]}, r"w\.jsonl:3: segments\[0\]\.label must be true .*got a int"),
        ({"segments": [seg("a", False), seg("b", False)]}, r"w\.jsonl:3: no segment with \"label\": true has text"),
        ({"segments": [seg("a", False), seg("", True)]}, r"w\.jsonl:3: no segment with \"label\": true has text"),
        ({"segments": [seg("", True)]}, r"w\.jsonl:3: no segment with \"label\": true has text"),
    ],
)
def test_bad_segments_rows_name_where_and_key(tok, row, pattern):
    with pytest.raises(PosttrainError, match=pattern):
        tokenize_row(row, "w.jsonl:3", tok)


def test_bad_segments_rows_from_a_file_raise_or_are_skipped_and_counted(tmp_path, tok):
    good = {"segments": [seg("q", False), seg("a", True)]}
    path = write_jsonl(tmp_path / "s.jsonl", [good, {"segments": [seg("q", "no")]}, good,
                                              {"segments": [seg("q", False)]}])
    with pytest.raises(PosttrainError, match=r"s\.jsonl:2: segments\[0\]\.label must be true"):
        load_examples(path, tok, max_length=32)
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 rows .*s\.jsonl:2"):
        ex, counts = load_examples(path, tok, max_length=32, skip_bad_rows=True)
    assert [e.where for e in ex] == [f"{path}:1", f"{path}:3"]
    assert counts == {"rows": 4, "skipped": 2, "truncated": 0, "dropped": 0}


# ---------------------------------------------------------------- load_examples


def test_load_examples_from_files(tok):
    examples, counts = load_examples(DATA / "sft_prompt_completion.jsonl", tok, max_length=32)
    assert counts == {"rows": 2, "skipped": 0, "truncated": 0, "dropped": 0}
    assert examples[1].ids.tolist() == [BOS, *b("2+2="), *b("4"), EOS]
    assert examples[1].loss_mask.tolist() == [0] * 5 + [1, 1]
    assert examples[1].ids.dtype == np.int32 and examples[1].loss_mask.dtype == np.int32
    assert examples[1].where == f"{DATA / 'sft_prompt_completion.jsonl'}:2"
    examples, _ = load_examples(DATA / "sft_text.jsonl", tok, max_length=32)
    assert [e.ids.tolist() for e in examples] == [[BOS, *b(t), EOS] for t in ("hi", "ok!", "héllo")]


def test_field_error_from_a_file_names_file_and_line(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"text": ["a"]}])
    with pytest.raises(PosttrainError, match=r"d\.jsonl:2: field 'text' must be a string"):
        load_examples(path, tok, max_length=32)


def test_truncation_policies(tmp_path, tok):
    # Lengths with bos + eos: 4, 8, 12.
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "ab"}, {"text": "abcdef"}, {"text": "abcdefghij"}])
    with pytest.raises(
        PosttrainError,
        match=r"t\.jsonl:3: the row is 12 tokens long, more than max_length=8.*keep_start.*keep_end.*drop",
    ):
        load_examples(path, tok, max_length=8)
    full = [BOS, *b("abcdefghij"), EOS]
    ex, counts = load_examples(path, tok, max_length=8, truncation="keep_start")
    assert [e.ids.tolist() for e in ex][2] == full[:8] and len(ex) == 3
    assert counts == {"rows": 3, "skipped": 0, "truncated": 1, "dropped": 0}
    ex, counts = load_examples(path, tok, max_length=8, truncation="keep_end")
    assert ex[2].ids.tolist() == full[-8:] and ex[2].loss_mask.tolist() == [1] * 8
    assert counts["truncated"] == 1
    ex, counts = load_examples(path, tok, max_length=8, truncation="drop")
    assert [len(e.ids) for e in ex] == [4, 8]
    assert counts == {"rows": 3, "skipped": 0, "truncated": 0, "dropped": 1}
    with pytest.raises(PosttrainError, match="truncation='middle' is not a policy"):
        load_examples(path, tok, max_length=8, truncation="middle")


def test_keep_start_that_cuts_the_whole_completion_drops_the_row(tmp_path, tok):
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "long prompt", "completion": "x"}, {"prompt": "q", "completion": "y"}],
    )
    ex, counts = load_examples(path, tok, max_length=6, truncation="keep_start")
    assert [e.ids.tolist() for e in ex] == [[BOS, *b("q"), *b("y"), EOS]]
    assert counts == {"rows": 2, "skipped": 0, "truncated": 0, "dropped": 1}
    ex, counts = load_examples(path, tok, max_length=6, truncation="keep_end")
    assert ex[0].ids.tolist() == [*b("ompt"), *b("x"), EOS] and ex[0].loss_mask.tolist() == [0] * 4 + [1, 1]


def test_skip_bad_rows_counts_and_warns_once(tmp_path, tok):
    path = write_jsonl(tmp_path / "s.jsonl", [{"text": "a"}, "{oops", {"txt": "b"}, {"text": "c"}])
    with pytest.raises(PosttrainError, match=r"s\.jsonl:2: the line is not valid JSON"):
        load_examples(path, tok, max_length=32)
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 rows .*s\.jsonl:2") as record:
        ex, counts = load_examples(path, tok, max_length=32, skip_bad_rows=True)
    assert len(record) == 1
    assert [e.where for e in ex] == [f"{path}:1", f"{path}:4"]
    assert counts == {"rows": 4, "skipped": 2, "truncated": 0, "dropped": 0}
    empty = write_jsonl(tmp_path / "e.jsonl", ["{oops"])
    with pytest.warns(UserWarning), pytest.raises(PosttrainError, match=r"e\.jsonl: no usable examples"):
        load_examples(empty, tok, max_length=32, skip_bad_rows=True)


# ---------------------------------------------------------------- arrays and packing


def ex(ids, mask):
    return Example(np.array(ids, np.int32), np.array(mask, np.int32), "x")


SMALL = [ex([10, 11, 12], [0, 1, 1]), ex([20, 21], [1, 1]), ex([30, 31, 32, 33], [1, 0, 1, 1]), ex([40], [1])]


def test_to_arrays_unpacked():
    a = to_arrays(SMALL, 6, PAD, packing=False)
    assert a["tokens"].tolist()[:2] == [[10, 11, 12, 0, 0, 0], [20, 21, 0, 0, 0, 0]]
    assert a["positions"][2].tolist() == [0, 1, 2, 3, 0, 0]
    assert a["segment_ids"][2].tolist() == [1, 1, 1, 1, 0, 0]
    assert a["targets"][2].tolist() == [31, 32, 33, 0, 0, 0]
    assert a["weights"][2].tolist() == [0, 1, 1, 0, 0, 0]
    assert a["targets"][0].tolist() == [11, 12, 0, 0, 0, 0] and a["weights"][0].tolist() == [1, 1, 0, 0, 0, 0]
    assert a["tokens"].shape == (4, 6)
    assert {k: v.dtype for k, v in a.items()} == {
        "tokens": np.int32,
        "positions": np.int32,
        "segment_ids": np.int32,
        "targets": np.int32,
        "weights": np.float32,
    }


def test_to_arrays_packed_first_fit():
    # Rows of 6: [A(3) B(2)] has 1 left, C(4) opens row 2, D(1) goes back into the FIRST row.
    a = to_arrays(SMALL, 6, PAD, packing=True)
    assert a["tokens"].tolist() == [[10, 11, 12, 20, 21, 40], [30, 31, 32, 33, 0, 0]]
    assert a["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 3], [1, 1, 1, 1, 0, 0]]
    assert a["positions"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert a["targets"].tolist() == [[11, 12, 0, 21, 0, 0], [31, 32, 33, 0, 0, 0]]
    assert a["weights"].tolist() == [[1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 0]]
    with pytest.raises(PosttrainError, match="x: the example is 4 tokens long, more than seq_len=3"):
        to_arrays(SMALL, 3, PAD, packing=True)


def random_examples(n, seed, max_len=20):
    rng = np.random.default_rng(seed)
    return [
        ex(rng.integers(7, 263, size=(k := int(rng.integers(2, max_len)))), rng.integers(0, 2, size=k))
        for _ in range(n)
    ]


def weighted_targets(a):
    """Multiset of (previous token, target, weight) for every trained position."""
    r, t = np.nonzero(a["weights"] > 0)
    return Counter(zip(a["tokens"][r, t].tolist(), a["targets"][r, t].tolist(), a["weights"][r, t].tolist()))


def test_packing_keeps_every_target_and_never_crosses_sequences():
    examples = random_examples(40, seed=0)
    packed, plain = to_arrays(examples, 24, PAD, True), to_arrays(examples, 24, PAD, False)
    assert len(packed["tokens"]) < len(plain["tokens"])
    assert weighted_targets(packed) == weighted_targets(plain)
    assert weighted_targets(plain) == Counter(
        (int(p), int(t), 1.0)
        for e in examples
        for p, t, m in zip(e.ids[:-1], e.ids[1:], e.loss_mask[1:])
        if m
    )
    seg, w, tgt, tokens = packed["segment_ids"], packed["weights"], packed["targets"], packed["tokens"]
    # A weighted position and its target are in the same, real segment.
    r, t = np.nonzero(w > 0)
    assert (
        (seg[r, t] > 0).all() and (seg[r, t + 1] == seg[r, t]).all() and (tgt[r, t] == tokens[r, t + 1]).all()
    )
    # At each segment's last token (boundary or padding next) the target and weight are 0.
    last = np.concatenate([seg[:, :-1] != seg[:, 1:], np.ones((len(seg), 1), bool)], axis=1) & (seg > 0)
    assert (w[last] == 0).all() and (tgt[last] == 0).all()
    # Positions restart at 0 at each segment start; padding is pad_id with segment 0.
    starts = (seg > 0) & np.concatenate([np.ones((len(seg), 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    assert (packed["positions"][starts] == 0).all() and (tokens[seg == 0] == PAD).all()


# ---------------------------------------------------------------- grain batches


def take(it, n):
    return [next(it) for _ in range(n)]


def rows_of(batch_list):
    return [tuple(row) for bt in batch_list for row in bt["tokens"].tolist()]


def test_batches_shapes_epochs_and_seeds():
    examples = random_examples(12, seed=1, max_len=10)
    kw = {"batch_size": 4, "seq_len": 10, "pad_id": PAD, "packing": False}
    epoch_rows = sorted(map(tuple, to_arrays(examples, 10, PAD, False)["tokens"].tolist()))
    got = list(batches(examples, seed=3, num_epochs=2, **kw))
    assert len(got) == 6  # 24 rows / 4
    assert all(
        bt[k].shape == (4, 10)
        for bt in got
        for k in ("tokens", "targets", "weights", "positions", "segment_ids")
    )
    assert got[0]["weights"].dtype == np.float32 and got[0]["tokens"].dtype == np.int32
    first, second = rows_of(got[:3]), rows_of(got[3:])
    assert sorted(first) == epoch_rows and sorted(second) == epoch_rows  # each epoch is every row once
    assert first != second  # and reshuffled
    assert rows_of(batches(examples, seed=3, num_epochs=2, **kw)) == first + second
    assert rows_of(batches(examples, seed=4, num_epochs=1, **kw)) != first
    assert rows_of(batches(examples, seed=3, num_epochs=1, shuffle=False, **kw)) == [
        tuple(r) for r in to_arrays(examples, 10, PAD, False)["tokens"].tolist()
    ]
    packed = list(batches(examples, seed=3, num_epochs=1, batch_size=1, seq_len=10, pad_id=PAD, packing=True))
    assert sorted(rows_of(packed)) == sorted(
        map(tuple, to_arrays(examples, 10, PAD, True)["tokens"].tolist())
    )
    with pytest.raises(PosttrainError, match="fewer than batch_size=40"):
        batches(examples, seed=3, num_epochs=1, batch_size=40, seq_len=10, pad_id=PAD, packing=False)


@pytest.mark.parametrize("packing", [False, True])
def test_batches_checkpoint_resumes_bitwise_across_epochs(packing):
    examples = random_examples(30, seed=2, max_len=12)
    ds = batches(examples, batch_size=3, seq_len=16, pad_id=PAD, packing=packing, seed=7)
    rows_per_epoch = len(to_arrays(examples, 16, PAD, packing)["tokens"])
    it = iter(ds)
    head = take(it, 2)
    state = it.get_state()
    expected = take(it, rows_per_epoch)  # runs past the end of the first epoch
    it2 = iter(batches(examples, batch_size=3, seq_len=16, pad_id=PAD, packing=packing, seed=7))
    it2.set_state(state)
    resumed = take(it2, rows_per_epoch)
    for a, c in zip(expected, resumed):
        for k in a:
            assert a[k].tobytes() == c[k].tobytes() and a[k].dtype == c[k].dtype
    # A fresh iterator replays from the start.
    assert rows_of(take(iter(ds), 2)) == rows_of(head)
