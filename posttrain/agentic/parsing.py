"""Tool calls in model text: parsing them out, and writing calls and tool results back.

What it is:
- `parse_tool_calls(text, fmt)` / `parse_tool_call(text, fmt)`: the calls a model wrote, in the
  formats the supported families use:
    "hermes"  Qwen 2.5 / Qwen 3 / Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
              (several blocks allowed; an unclosed last block is read to the end of the text,
              since sampling usually stops *at* the closing tag)
    "llama3"  Llama 3.1+ JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`
              (or "arguments"), optionally after `<|python_tag|>`, several joined by ";", ending
              in `<|eom_id|>` / `<|eot_id|>` or not; after `<|python_tag|>` the built-in-tool
              form `brave_search.call(query="...")` is read too
    "gemma"   Gemma (Google's function-calling guide for Gemma 3): a ```tool_code block holding
              Python calls, `name(arg=value)`, optionally wrapped in `print(...)`; values must be
              literals (read with `ast.literal_eval`, never executed)
  and "auto" (the first of the three whose marker the text holds). A well-formed call is a
  `ToolCall`; a malformed one (bad JSON, no name, non-literal argument) is a `ToolCallError`
  with the reason, never an exception; text with no call gives [] / None.
- Writing back: `format_tool_call` (the text a model of that family emits for a call, used by
  the demonstrations), `render_tool_result` (the plain-text tool output appended after a call:
  `<tool_response>...</tool_response>` or a ```tool_output block, for the byte tokenizer, which
  has no tool role), `tool_message` / `assistant_tool_call_message` (chat messages in the HF
  format, for a real tokenizer's chat template), `stop_strings(fmt)` (where sampling should stop
  so the tool can run).

What it is not: the rollout loop (`env.py` runs tools on parsed calls), nor a JSON-schema
validator (the tool checks its own arguments).
References: Qwen function calling docs and the Qwen2.5/Qwen3 chat templates (`<tool_call>`,
`<tool_response>`); Meta's Llama 3.1 model card / prompt format (JSON tool calls, `<|python_tag|>`,
`<|eom_id|>`, the "ipython" role); Google's "Function calling with Gemma" guide (```tool_code /
```tool_output); HF transformers' chat-template tool-use format (role "tool", `tool_calls`).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from typing import Any, Mapping, Optional, Union

FORMATS = ("hermes", "llama3", "gemma")

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_GEMMA = re.compile(r"```tool_code[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END = ("<|eom_id|>", "<|eot_id|>")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A parsed call: the tool's `name`, its `arguments`, the `format` it was written in and the
    `text` of the call as it appeared."""

    name: str
    arguments: dict
    format: str
    text: str


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to write but got wrong: `message` says why (it goes back to the model)."""

    message: str
    format: str
    text: str


Parsed = Union[ToolCall, ToolCallError]


def _from_dict(obj: Any, fmt: str, text: str, arg_keys: tuple[str, ...]) -> Parsed:
    """A ToolCall from {"name": str, <arg_key>: dict or a JSON string of one}, else a ToolCallError."""
    if not isinstance(obj, dict):
        return ToolCallError(f"a tool call must be a JSON object, got {type(obj).__name__}", fmt, text)
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('a tool call needs a "name" string', fmt, text)
    args: Any = {}
    for key in arg_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as err:
            return ToolCallError(f'the "{arg_keys[0]}" string is not JSON: {err.msg}', fmt, text)
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCallError(f'"{arg_keys[0]}" must be a JSON object, got {type(args).__name__}', fmt, text)
    return ToolCall(name, args, fmt, text)


def _hermes(text: str) -> list[Parsed]:
    out: list[Parsed] = []
    for m in _HERMES.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as err:
            out.append(ToolCallError(f"the tool call is not valid JSON: {err.msg} at character {err.pos}",
                                     "hermes", m.group(0)))
            continue
        out.append(_from_dict(obj, "hermes", m.group(0), ("arguments", "parameters")))
    return out


def _llama3(text: str) -> list[Parsed]:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    for end in _LLAMA_END:
        if end in body:
            body = body[: body.index(end)].strip()
    if not body.startswith("{"):
        return _python_calls(body, "llama3", text, None) if tagged and body else []
    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except json.JSONDecodeError as err:
            out.append(ToolCallError(f"the tool call is not valid JSON: {err.msg} at character {err.pos}",
                                     "llama3", body[i:]))
            break
        out.append(_from_dict(obj, "llama3", body[i:end], ("parameters", "arguments")))
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return out


def _call_name(func: ast.expr) -> Optional[str]:
    """`f` -> "f", `a.b` -> "a.b", `brave_search.call` -> "brave_search" (Llama's built-in form)."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    parts.append(func.id)
    name = ".".join(reversed(parts))
    return name[: -len(".call")] if name.endswith(".call") else name


def _python_calls(source: str, fmt: str, text: str, tools: Optional[Mapping]) -> list[Parsed]:
    """Calls written as Python (`name(a=1)` or `print(name(a=1))`, one per line), arguments read with
    `ast.literal_eval`. Positional arguments take the tool's parameter names in schema order when
    `tools` knows the tool, else they are an error."""
    try:
        tree = ast.parse(source.strip(), mode="exec")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        return [ToolCallError(f"the tool call is not valid Python: {getattr(err, 'msg', err)}", fmt, text)]
    out: list[Parsed] = []
    for stmt in tree.body:
        node = stmt.value if isinstance(stmt, ast.Expr) else None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
                and len(node.args) == 1 and not node.keywords):
            node = node.args[0]
        seg = ast.get_source_segment(source.strip(), stmt) or text
        name = _call_name(node.func) if isinstance(node, ast.Call) else None
        if name is None:
            out.append(ToolCallError("a tool call must be a function call like name(arg=value)", fmt, seg))
            continue
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            positional = [ast.literal_eval(a) for a in node.args]
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            out.append(ToolCallError(f"the arguments of {name} must be literals (numbers, strings, lists, dicts)",
                                     fmt, seg))
            continue
        if any(kw.arg is None for kw in node.keywords):
            out.append(ToolCallError(f"{name}: **kwargs is not allowed in a tool call", fmt, seg))
            continue
        if positional:
            tool = (tools or {}).get(name)
            names = list(((getattr(tool, "parameters", None) or {}).get("properties") or {}).keys())
            if len(positional) > len(names):
                out.append(ToolCallError(f"{name}: write the arguments as keywords, e.g. {name}(arg=value)", fmt, seg))
                continue
            args = {**dict(zip(names, positional)), **args}
        out.append(ToolCall(name, args, fmt, seg))
    return out


def _gemma(text: str, tools: Optional[Mapping]) -> list[Parsed]:
    out: list[Parsed] = []
    for m in _GEMMA.finditer(text):
        out.extend(_python_calls(m.group(1), "gemma", m.group(0), tools))
    return out


def detect_format(text: str) -> Optional[str]:
    """The format whose marker `text` holds ("hermes", "gemma", "llama3"), or None."""
    if "<tool_call>" in text:
        return "hermes"
    if "```tool_code" in text:
        return "gemma"
    body = text.lstrip()
    if body.startswith(_PYTHON_TAG) or (body.startswith("{") and '"name"' in body):
        return "llama3"
    return None


def parse_tool_calls(text: str, fmt: str = "auto", *, tools: Optional[Mapping] = None) -> list[Parsed]:
    """Every call in `text` in format `fmt` ("auto" detects it), in order: ToolCall or ToolCallError.
    `tools` (name -> Tool) lets a Gemma-style call pass positional arguments."""
    if fmt == "auto":
        fmt = detect_format(text) or ""
        if not fmt:
            return []
    if fmt == "hermes":
        return _hermes(text)
    if fmt == "llama3":
        return _llama3(text)
    if fmt == "gemma":
        return _gemma(text, tools)
    raise ValueError(f"unknown tool-call format {fmt!r}; use one of {FORMATS} or 'auto'")


def parse_tool_call(text: str, fmt: str = "auto", *, tools: Optional[Mapping] = None) -> Optional[Parsed]:
    """The first call in `text` (ToolCall or ToolCallError), or None when there is none."""
    calls = parse_tool_calls(text, fmt, tools=tools)
    return calls[0] if calls else None


# ----------------------------------------------------------------------------- writing back


def _literal(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


def format_tool_call(name: str, arguments: Mapping, fmt: str = "hermes") -> str:
    """The text a model of family `fmt` writes for a call (compact JSON, no trailing newline)."""
    if fmt == "hermes":
        return "<tool_call>" + json.dumps({"name": name, "arguments": dict(arguments)}) + "</tool_call>"
    if fmt == "llama3":
        return json.dumps({"name": name, "parameters": dict(arguments)})
    if fmt == "gemma":
        args = ", ".join(f"{k}={_literal(v)}" for k, v in arguments.items())
        return f"```tool_code\n{name}({args})\n```"
    raise ValueError(f"unknown tool-call format {fmt!r}; use one of {FORMATS}")


def render_tool_result(content: str, fmt: str = "hermes") -> str:
    """A tool's output as plain text to append right after the call (byte tokenizer, no chat roles):
    hermes / llama3 `\\n<tool_response>\\n...\\n</tool_response>\\n`, gemma a ```tool_output block."""
    if fmt in ("hermes", "llama3"):
        return f"\n<tool_response>\n{content}\n</tool_response>\n"
    if fmt == "gemma":
        return f"\n```tool_output\n{content}\n```\n"
    raise ValueError(f"unknown tool-call format {fmt!r}; use one of {FORMATS}")


def tool_message(content: str, *, name: Optional[str] = None, call_id: Optional[str] = None,
                 fmt: str = "hermes") -> dict:
    """The chat message that carries a tool's output, for `apply_chat_template`: role "tool" (Qwen's and
    Llama 3.1's templates render it as `<tool_response>` / the "ipython" header); Gemma's template has
    no tool role, so there it is a user message with a ```tool_output block (Google's guide)."""
    if fmt == "gemma":
        return {"role": "user", "content": f"```tool_output\n{content}\n```"}
    msg = {"role": "tool", "content": content}
    if name is not None:
        msg["name"] = name
    if call_id is not None:
        msg["tool_call_id"] = call_id
    return msg


def assistant_tool_call_message(calls: list[ToolCall], content: str = "") -> dict:
    """The assistant message of HF's tool-use format: {"role": "assistant", "content",
    "tool_calls": [{"type": "function", "function": {"name", "arguments"}}]}."""
    return {"role": "assistant", "content": content,
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
                           for c in calls]}


def stop_strings(fmt: str = "hermes") -> tuple[str, ...]:
    """Where sampling should stop so the tool can run (the sampled text keeps the stop string).
    Llama 3 ends a tool turn with the special token `<|eom_id|>` (with a real tokenizer a stop id).
    Gemma's is the fence that closes the block, "\\n```\\n"; it also closes any other fenced block
    the model writes, so a rollout should check `ends_tool_call` before treating the stop as a call."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; use one of {FORMATS}")
    return {"hermes": ("</tool_call>",), "llama3": ("<|eom_id|>",), "gemma": ("\n```\n",)}[fmt]


def ends_tool_call(text: str, fmt: str = "hermes") -> bool:
    """True when `text` ends with a finished call of format `fmt` (the point where the tool runs)."""
    body = text.rstrip()
    if fmt == "hermes":
        return body.endswith("</tool_call>") and bool(_hermes(body))
    if fmt == "llama3":
        return bool(_llama3(text)) and (text.rstrip().endswith(_LLAMA_END) or body.endswith(("}", ")")))
    if fmt == "gemma":
        last = body.rfind("```tool_code")
        return last >= 0 and body.endswith("```") and body.count("```", last) >= 2
    raise ValueError(f"unknown tool-call format {fmt!r}; use one of {FORMATS}")
