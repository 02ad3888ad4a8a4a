"""Agentic episodes (issue #13): tools, tool-call parsing, environments and their batched rollouts.

What it is (one idea a module):
  tools.py           Tool protocol; `calculator` (exact, ast-based) and `python` (subprocess with time,
                     memory, CPU and file-size limits and an audit-hook guard: best effort, not a
                     security boundary); TOOLS registry, make_tools, tool_schemas
  (the python tool runs programs in posttrain.sandbox)
  parsing.py         tool calls in Hermes/Qwen `<tool_call>`, Llama 3 JSON and Gemma ```tool_code formats;
                     malformed calls are ToolCallError values; tool results as text or chat messages
  env.py             Environment protocol (reset / step), ToolEnv (parse, run the tool, score at the end),
                     run_episode, encode_segments (ids + loss mask; tool outputs untrained), verify_answer
  rollout.py         run_episodes: batched multi-turn episodes on the shared sampler (Sampler.begin / extend:
                     the KV cache extended with each tool output, finished episodes leave the batch);
                     episode_rows (GRPO rows, tool outputs masked), AgenticRollout (GRPO's batch source),
                     evaluate (held-out accuracy and tool-use rate)
  config.py          the `env:` and `tools:` sections of `posttrain grpo`; make_env_factory
The built-in tool task is `posttrain.tasks.tool_arithmetic`; the learning recipe's start (task data and a
tiny model SFT-ed to call the calculator sometimes) is the demo `posttrain.demos.agentic`.

What it is not: chat-template rendering of tool turns for a real tokenizer's roles (observations are
appended as text, `render_tool_result`), nor a sandbox for untrusted code (see tools.py).
"""

from posttrain.agentic.config import EnvSection, PythonToolSection, ToolsSection, make_env_factory
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
from posttrain.agentic.rollout import (
    AgenticRollout,
    SampledEpisode,
    episode_rows,
    episode_stats,
    evaluate,
    run_episodes,
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
    # batched multi-turn rollouts and their GRPO wiring
    "run_episodes", "SampledEpisode", "episode_rows", "episode_stats", "AgenticRollout", "evaluate",
    "EnvSection", "ToolsSection", "PythonToolSection", "make_env_factory",
]
