"""Tool-call parsing (Hermes/Qwen, Llama 3, Gemma: valid, malformed, none), the tool environment on a
scripted episode, and the tool_arithmetic task (split, verifier, demonstrations whose tool outputs are
never trained) (posttrain/agentic/parsing.py, env.py; posttrain/tasks/tool_arithmetic.py)."""

import json

import pytest

from posttrain.agentic import (
    Environment,
    ToolCall,
    ToolCallError,
    ToolEnv,
    assistant_tool_call_message,
    detect_format,
    encode_segments,
    ends_tool_call,
    format_tool_call,
    parse_tool_call,
    parse_tool_calls,
    render_tool_result,
    run_episode,
    stop_strings,
    tool_message,
)
from posttrain.agentic.tools import Calculator
from posttrain.errors import PosttrainError
from posttrain.tasks import tool_arithmetic as tool_task

CALC = {"calculator": Calculator()}


# ----------------------------------------------------------------------------- parsing


def test_hermes_calls():
    text = 'Let me compute.<tool_call>\n{"name": "calculator", "arguments": {"expression": "437*829"}}\n</tool_call>'
    call = parse_tool_call(text, "hermes")
    assert call == ToolCall("calculator", {"expression": "437*829"}, "hermes", text[len("Let me compute."):])
    two = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
                           '<tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}</tool_call>', "hermes")
    assert [(c.name, c.arguments) for c in two] == [("a", {}), ("b", {"x": 1})]  # JSON-string arguments decoded
    # sampling stopped before the closing tag: the call is still read
    assert parse_tool_call('<tool_call>{"name": "a", "arguments": {"k": 2}}', "hermes").arguments == {"k": 2}


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>{"name": calculator}</tool_call>', "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "a", "arguments": "{not json"}</tool_call>', "not JSON"),
])
def test_hermes_malformed_is_an_error_value(text, reason):
    call = parse_tool_call(text, "hermes")
    assert isinstance(call, ToolCallError) and reason in call.message and call.format == "hermes"


def test_llama3_calls():
    call = parse_tool_call('<|python_tag|>{"name": "calculator", "parameters": {"expression": "2*3"}}<|eom_id|>',
                           "llama3")
    assert (call.name, call.arguments, call.format) == ("calculator", {"expression": "2*3"}, "llama3")
    calls = parse_tool_calls('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": 2}}', "llama3")
    assert [(c.name, c.arguments) for c in calls] == [("a", {"x": 1}), ("b", {"y": 2})]
    builtin = parse_tool_call('<|python_tag|>brave_search.call(query="jax nnx")', "llama3")
    assert (builtin.name, builtin.arguments) == ("brave_search", {"query": "jax nnx"})
    bad = parse_tool_call('{"name": "a", "parameters": {"x": 1}', "llama3")  # unbalanced
    assert isinstance(bad, ToolCallError) and "not valid JSON" in bad.message
    assert parse_tool_call("The answer is 6.", "llama3") is None


def test_gemma_calls():
    text = 'I will call it.\n```tool_code\nprint(calculator(expression="437*829"))\n```'
    call = parse_tool_call(text, "gemma")
    assert (call.name, call.arguments, call.format) == ("calculator", {"expression": "437*829"}, "gemma")
    # positional arguments take the schema's parameter names when the tool is known
    positional = parse_tool_call('```tool_code\ncalculator("1+1")\n```', "gemma", tools=CALC)
    assert positional.arguments == {"expression": "1+1"}
    assert isinstance(parse_tool_call('```tool_code\ncalculator("1+1")\n```', "gemma"), ToolCallError)
    # arguments must be literals: nothing is executed
    bad = parse_tool_call('```tool_code\ncalculator(expression=__import__("os").system("x"))\n```', "gemma")
    assert isinstance(bad, ToolCallError) and "literals" in bad.message
    assert isinstance(parse_tool_call("```tool_code\ncalculator(expression='1'\n```", "gemma"), ToolCallError)
    assert isinstance(parse_tool_call("```tool_code\n1 + 1\n```", "gemma"), ToolCallError)
    assert parse_tool_call("```python\nprint(1)\n```", "gemma") is None


def test_auto_detection_and_no_call():
    assert detect_format('<tool_call>{"name": "a"}</tool_call>') == "hermes"
    assert detect_format('<|python_tag|>{"name": "a", "parameters": {}}') == "llama3"
    assert detect_format('```tool_code\na()\n```') == "gemma"
    for text in ["#### 362273", "", "{not a call}", "I would use <tool_response> here"]:
        assert parse_tool_call(text) is None and parse_tool_calls(text) == []
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("x", "mistral")


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "gemma"])
def test_format_round_trip_and_rendering(fmt):
    args = {"expression": "12*34", "n": 3}
    text = format_tool_call("calculator", args, fmt)
    call = parse_tool_call(text)  # auto detects what we wrote
    assert (call.name, call.arguments, call.format) == ("calculator", args, fmt)
    rendered = render_tool_result("408", fmt)
    assert "408" in rendered and parse_tool_call(rendered) is None  # a tool result never reads as a call
    assert isinstance(stop_strings(fmt), tuple)
    if fmt != "llama3":
        assert ends_tool_call(text, fmt) and not ends_tool_call(text[:-3], fmt)


def test_chat_messages():
    assert render_tool_result("408") == "\n<tool_response>\n408\n</tool_response>\n"
    assert tool_message("408", name="calculator") == {"role": "tool", "content": "408", "name": "calculator"}
    assert tool_message("408", fmt="gemma") == {"role": "user", "content": "```tool_output\n408\n```"}
    msg = assistant_tool_call_message([ToolCall("calculator", {"expression": "1+1"}, "hermes", "")])
    assert msg["tool_calls"] == [{"type": "function", "function": {"name": "calculator",
                                                                   "arguments": {"expression": "1+1"}}}]


# ----------------------------------------------------------------------------- environment


def scripted(answer_from_tool=True, call_text=None):
    """A fake policy: first a calculator call on the prompt's expression, then the tool's number as the answer."""

    def policy(transcript: str) -> str:
        if "<tool_response>" not in transcript:
            expr = transcript.split("Compute ", 1)[1].split(".", 1)[0]
            return call_text or format_tool_call("calculator", {"expression": expr})
        result = transcript.rsplit("<tool_response>\n", 1)[1].split("\n", 1)[0]
        return f"#### {result if answer_from_tool else int(result) + 1}"

    return policy


def test_tool_env_scripted_episode_is_scored():
    row = tool_task.make_row([437, 829], "*")
    env = tool_task.make_env()
    assert isinstance(env, Environment)
    ep = run_episode(env, scripted(), row)
    assert ep.done and ep.reward == 1.0 and ep.turns == 2 and ep.tool_calls == 1 and ep.parse_errors == 0
    assert [t for t, _ in ep.segments] == [t for t, _ in tool_task.demonstration(row)]
    assert [m for _, m in ep.segments] == [False, True, False, True]
    assert ep.final == "#### 362273"
    wrong = run_episode(tool_task.make_env(), scripted(answer_from_tool=False), row)
    assert wrong.reward == 0.0 and wrong.tool_calls == 1


def test_tool_env_step_by_step_errors_and_turn_limit():
    row = tool_task.make_row([12, 34], "*")
    env = ToolEnv(CALC, tool_task.verify, max_turns=3)
    assert env.reset(row) == row["prompt"]
    obs, reward, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": 408}}</tool_call>')
    assert not done and reward == 0.0 and obs.startswith("\n<tool_response>\nError:")  # a number, not a string
    obs, _, done = env.step('<tool_call>{"name": "calc"}</tool_call>')
    assert not done and "unknown tool 'calc'" in obs
    obs, reward, done = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>')
    assert done and obs is None and reward == 0.0  # third turn is the last: the call is not run
    assert env.episode.tool_calls == 1 and env.episode.tool_errors == 2 and env.episode.turns == 3
    with pytest.raises(RuntimeError):
        env.step("#### 408")
    env.reset(row)
    _, _, _ = env.step("<tool_call>{broken</tool_call>")
    assert env.episode.parse_errors == 1 and "could not parse" in env.segments[-1][0]
    assert env.step("#### 408") == (None, 1.0, True)  # answering without the tool also counts
    with pytest.raises(PosttrainError, match="prompt"):
        env.reset({"question": "x"})


# ----------------------------------------------------------------------------- task


def _key(row):
    return tuple(sorted(int(t) for t in row["expression"].replace("+", "*").split("*")))


def test_task_split_is_disjoint_and_reproducible():
    a = tool_task.make(2, seed=0, n_train=300, n_eval=50)
    b = tool_task.make(2, seed=0, n_train=300, n_eval=50)
    c = tool_task.make(2, seed=1, n_train=300, n_eval=50)
    assert a.prompts == b.prompts and a.eval_prompts == b.eval_prompts and a.demos == b.demos
    assert a.prompts != c.prompts
    train, held = {_key(r) for r in a.prompts}, {_key(r) for r in a.eval_prompts}
    assert len(train) == 300 and len(held) == 50 and not train & held
    for row in a.prompts[:20] + a.eval_prompts[:20]:
        x, y = map(int, row["expression"].split("*"))
        assert 100 <= x <= 999 and 100 <= y <= 999 and row["answer"] == str(x * y)
        assert "calculator" in row["prompt"]
    sums = tool_task.make(3, seed=0, n_train=20, n_eval=5)
    row = sums.prompts[0]
    assert row["expression"].count("+") == 3 and row["answer"] == str(sum(map(int, row["expression"].split("+"))))
    with pytest.raises(PosttrainError, match="too many"):
        tool_task.make({"digits": 1, "op": "*"}, n_train=100, n_eval=10)


def test_task_verifier():
    row = tool_task.make_row([437, 829], "*")
    assert tool_task.verify(row, "#### 362273") == 1.0
    assert tool_task.verify(row, "The product is 362,273") == 1.0
    assert tool_task.verify(row, "#### 362274") == 0.0
    assert tool_task.verify(row, "") == 0.0
    assert tool_task.verify(row, format_tool_call("calculator", {"expression": "437*829"})) == 0.0


def test_demonstrations_never_train_on_tool_output():
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    data = tool_task.make(2, seed=0, n_train=10, n_eval=2)
    for row, segments in zip(data.prompts, data.demos):
        texts = [t for t, _ in segments]
        assert [m for _, m in segments] == [False, True, False, True]
        assert texts[2] == render_tool_result(row["answer"]) and texts[3] == f"#### {row['answer']}"
        call = json.loads(texts[1][len("<tool_call>"):-len("</tool_call>")])
        assert call == {"name": "calculator", "arguments": {"expression": row["expression"]}}
        ids, mask = encode_segments(segments, lambda s: tok.encode(s, add_special_tokens=False))
        assert ids == tok.encode("".join(texts), add_special_tokens=False)  # bytes: segments tokenize alone
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        assert trained == texts[1] + texts[3]
        # every token of the tool output (and of the prompt) has mask 0
        start = len(tok.encode(texts[0] + texts[1], add_special_tokens=False))
        end = start + len(tok.encode(texts[2], add_special_tokens=False))
        assert not any(mask[start:end]) and not any(mask[:len(tok.encode(texts[0], add_special_tokens=False))])
        assert tool_task.verify(row, texts[3]) == 1.0


def test_agentic_sft_rows_are_segments_rows_that_train_the_model_text_only():
    """The agentic demo's SFT data (`demos.agentic.sft_rows`) in the SFT recipe's "segments" format: ids are
    BOS + the episode's bytes + EOS; the trained tokens are the call and the answer (+ EOS), never the prompt
    nor the tool output; about `tool_fraction` of the rows call the calculator."""
    from posttrain.data import tokenize_row
    from posttrain.demos.agentic import sft_rows
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    data = tool_task.make(2, seed=0, n_train=40, n_eval=2)
    rows = sft_rows(data.prompts, tool_fraction=0.5, seed=0)
    assert rows == sft_rows(data.prompts, tool_fraction=0.5, seed=0)  # the seed fixes which rows call
    calls = 0
    for row, demo, episode in zip(data.prompts, data.demos, rows):
        ids, mask = tokenize_row(json.loads(json.dumps(episode)), "agentic", tok)
        texts = [s["text"] for s in episode["segments"]]
        assert ids == [tok.bos_id, *tok.encode("".join(texts), add_special_tokens=False), tok.eos_id]
        assert texts[0] == row["prompt"] and not any(mask[:1 + len(row["prompt"])]) and mask[-1] == 1
        trained = tok.decode([i for i, m in zip(ids[:-1], mask[:-1]) if m])
        if len(texts) == 4:  # the demonstration: prompt, call, tool output, answer
            calls += 1
            assert [(s["text"], s["label"]) for s in episode["segments"]] == [(t, bool(m)) for t, m in demo]
            assert trained == texts[1] + texts[3]
        else:  # a direct answer (a guess)
            assert [s["label"] for s in episode["segments"]] == [False, True]
            assert trained == texts[1] == f"#### {row['answer']}"
    assert 10 <= calls <= 30
