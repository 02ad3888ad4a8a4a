"""The `env:` and `tools:` config sections of `posttrain grpo`, and the environment factory they describe.

What it is: frozen dataclasses read by `config.from_dict` (typed, unknown keys are errors naming
them) and `make_env_factory(env, tools)`, which builds the tools once and returns `make_env()`, a
fresh `ToolEnv` per episode (tools are shared: the built-ins keep no state between calls).

    env:
      enabled: true          # multi-turn episodes instead of single completions
      verifier: answer       # or package.module:function  f(row, final_text) -> float
      format: hermes         # hermes | llama3 | gemma
      max_turns: 3
      max_tokens: 192        # after the prompt: actions + tool outputs
    tools:
      names: [calculator]    # calculator, python, or package.module:name
      python: {timeout_s: 2}

What it is not: the rollout (`rollout.py`) or the tools (`tools.py`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Literal, Optional

from posttrain import config as C
from posttrain.agentic.env import ToolEnv, verify_answer
from posttrain.agentic.tools import TOOLS, Tool, make_tools
from posttrain.errors import PosttrainError
from posttrain.sandbox import MODES


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnvSection(C.Section):
    """Multi-turn episodes with tool calls (posttrain/agentic); off unless enabled."""

    key = "env"

    enabled: bool = False  # episodes: the model calls tools, their outputs are appended, the last action is scored
    verifier: str = "answer"  # episode reward: "answer" (final `#### N` = the row's answer) or "module:function"
    format: Literal["hermes", "llama3", "gemma"] = "hermes"  # the tool-call format the model writes
    max_turns: C.AtLeast1 = 3  # actions per episode at most (the last is scored whatever it is)
    # tokens after the prompt: actions + tool outputs (grpo.max_new_tokens bounds one action)
    max_tokens: C.AtLeast1 = 256
    tool_workers: C.AtLeast1 = 4  # threads that run one round's tool calls

    def __post_init__(self):
        super().__post_init__()
        if self.verifier != "answer" and ":" not in self.verifier:
            raise PosttrainError(f"env.verifier: unknown verifier {self.verifier!r}; use 'answer' or "
                                 "'package.module:function'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PythonToolSection(C.Section):
    """Limits of the python tool (a sandboxed subprocess; see posttrain/agentic/tools.py)."""

    key = "tools.python"

    timeout_s: C.Positive = 5.0  # wall-clock seconds before the process group is killed
    memory_mb: C.AtLeast1 = 512  # address-space limit of the child in MB
    cpu_s: Optional[C.AtLeast1] = None  # CPU-seconds limit; null: ceil(timeout_s) + 1
    max_output_chars: C.AtLeast1 = 2000  # stdout + stderr characters returned to the model
    max_file_mb: C.AtLeast1 = 16  # the largest file the child may write, in MB
    max_open_files: C.AtLeast1 = 64  # open file descriptors of the child
    sandbox: str = "auto"  # the boundary: auto (bwrap, else a fresh uid as root), bwrap, uid, unsafe_inprocess_guard

    def __post_init__(self):
        super().__post_init__()
        if self.sandbox not in MODES:
            raise PosttrainError(f"tools.python.sandbox: unknown mode {self.sandbox!r}; use one of {', '.join(MODES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToolsSection:
    """The tools an episode's model may call (used when env.enabled)."""

    names: tuple[str, ...] = ("calculator",)  # calculator, python, or "package.module:name" (a Tool or its factory)
    python: PythonToolSection = dataclasses.field(default_factory=PythonToolSection)  # the python tool's limits

    def __post_init__(self):
        if not self.names:
            raise PosttrainError("tools.names is empty; name at least one tool, e.g. [calculator]")
        for name in self.names:
            if name not in TOOLS and ":" not in name:
                raise PosttrainError(f"tools.names: unknown tool {name!r}; the built-in tools are "
                                     f"{', '.join(sorted(TOOLS))}, or give 'package.module:name'")
        if len(set(self.names)) != len(self.names):
            raise PosttrainError(f"tools.names lists a tool twice: {list(self.names)}")


def _import(name: str, key: str):
    mod, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(mod), attr)
    except Exception as err:  # ImportError, AttributeError, an error inside the user's module
        raise PosttrainError(f"{key}: cannot import {name!r} ({type(err).__name__}: {err}); give "
                             "'package.module:name'") from None


def build_tools(section: ToolsSection) -> dict[str, Tool]:
    """name -> Tool for tools.names (built-ins with their settings, imported tools as given)."""
    builtin = [n for n in section.names if n in TOOLS]
    spec = {n: (dataclasses.asdict(section.python) if n == "python" else None) for n in builtin}
    tools = make_tools(spec)
    for name in section.names:
        if name in TOOLS:
            continue
        obj = _import(name, "tools.names")
        tool = obj() if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Tool)) else obj
        if not isinstance(tool, Tool):
            raise PosttrainError(f"tools.names: {name!r} is not a tool (it needs name, description, parameters "
                                 "and call(arguments))")
        tools[tool.name] = tool
    return tools


def resolve_verifier(name: str) -> Callable:
    if name == "answer":
        return verify_answer
    fn = _import(name, "env.verifier")
    if not callable(fn):
        raise PosttrainError(f"env.verifier: {name!r} is not a function")
    return fn


def make_env_factory(env: EnvSection, tools: ToolsSection) -> Callable[[], ToolEnv]:
    """make_env(): a fresh ToolEnv per episode over the shared tools, scored by env.verifier."""
    built, verifier = build_tools(tools), resolve_verifier(env.verifier)
    return lambda: ToolEnv(built, verifier, max_turns=env.max_turns, fmt=env.format)
