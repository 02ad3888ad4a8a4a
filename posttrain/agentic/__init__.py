"""Agentic episodes (issue #13): tools, tool-call parsing, environments and a built-in tool task.

What it is (one idea a module):
  tools.py           Tool protocol; `calculator` (exact, ast-based) and `python` (subprocess with time,
                     memory, CPU and file-size limits and an audit-hook guard: best effort, not a
                     security boundary); TOOLS registry, make_tools, tool_schemas
  _sandbox_child.py  the python tool's child process: its own limits and the audit hook, then the program
  parsing.py         tool calls in Hermes/Qwen `<tool_call>`, Llama 3 JSON and Gemma ```tool_code formats;
                     malformed calls are ToolCallError values; tool results as text or chat messages
  env.py             Environment protocol (reset / step), ToolEnv (parse, run the tool, score at the end),
                     run_episode, encode_segments (ids + loss mask; tool outputs untrained)
  task.py            tool_arithmetic: long products / sums, seeded disjoint split, verifier, demonstrations

What it is not (yet): the batched multi-turn rollout on the shared sampler and its GRPO wiring.
"""

from posttrain.agentic.env import Environment, Episode, ToolEnv, encode_segments, run_episode
from posttrain.agentic.parsing import (
    FORMATS,
    ToolCall,
    ToolCallError,
    assistant_tool_call_message,
    detect_format,
    ends_tool_call,
    format_tool_call,
    parse_tool_call,
    parse_tool_calls,
    render_tool_result,
    stop_strings,
    tool_message,
)
from posttrain.agentic.tools import (
    TOOLS,
    Calculator,
    PythonResult,
    PythonTool,
    Tool,
    calculate,
    make_tools,
    tool_schemas,
)

__all__ = [
    # tools
    "Tool", "Calculator", "PythonTool", "PythonResult", "TOOLS", "make_tools", "tool_schemas", "calculate",
    # parsing and rendering
    "FORMATS", "ToolCall", "ToolCallError", "parse_tool_call", "parse_tool_calls", "detect_format",
    "ends_tool_call", "format_tool_call", "render_tool_result", "tool_message", "assistant_tool_call_message",
    "stop_strings",
    # environments
    "Environment", "Episode", "ToolEnv", "run_episode", "encode_segments",
]
