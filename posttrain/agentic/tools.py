"""Tools a model can call during an episode: the protocol, the built-ins and their registry.

What it is:
- `Tool`: anything with `name`, `description`, `parameters` (a JSON Schema object of the
  arguments, as HF chat templates' `tools=` and the OpenAI function format expect) and
  `call(arguments: dict) -> str`. A tool never raises for bad model input: it returns an error
  text starting with "Error:", which goes back to the model as the tool's output.
- `Calculator` ("calculator"): exact arithmetic on an expression string. The grammar is
  `rewards.functions.safe_arithmetic`'s (non-negative integers, + - * /, parentheses; parsed with
  `ast`, evaluated with Fractions, never `eval`-ed), extended with unary +/-, decimals and `**`
  with an integer exponent of at most `rewards.arithmetic.MAX_EXPONENT` (a result of at most `MAX_RESULT_BITS`).
- `PythonTool` ("python"): runs a program in `posttrain.sandbox` (bubblewrap namespaces: no host
  processes, no network, a read-only system and one private size-limited tmpfs; rlimits on time,
  memory, CPU, file size, open files and processes; the Python audit-hook guard as defence in depth).
  stdout and stderr come back truncated to `max_output_chars`.
- `TOOLS` (name -> class), `make_tools(spec)` (names or {name: kwargs}, as a config's `tools:`
  section gives them) and `tool_schemas(tools)` (the list for `apply_chat_template(tools=...)`).

What it is not: a place for trusted code (a tool named `package.module:name` runs in this process).
The boundary, its fallbacks and what each stops: `posttrain/sandbox/__init__.py`, docs/security.md.

References: Python's audit events table (docs.python.org/3/library/audit_events.html) and
PEP 578 (which itself warns that audit hooks are not a sandbox); Hermes / Qwen / Llama 3
function-calling JSON Schemas for `parameters`.
"""

from __future__ import annotations

import dataclasses
import sys
from fractions import Fraction
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from posttrain.errors import PosttrainError
from posttrain.rewards.arithmetic import evaluate
from posttrain.sandbox import Sandbox


@runtime_checkable
class Tool(Protocol):
    """A callable tool: its name, a one-line description, a JSON Schema of its arguments, and call()."""

    name: str
    description: str
    parameters: dict

    def call(self, arguments: dict) -> str:
        """The tool's output for `arguments` (never raises for bad input: returns "Error: ...")."""
        ...


def _string_argument(arguments: Any, key: str, tool: str) -> tuple[str | None, str | None]:
    """(value, None) for arguments[key] as a string, or (None, an error text). A dict with exactly one
    string value is accepted under any key (models often misname the single argument)."""
    if not isinstance(arguments, Mapping):
        return None, f"Error: {tool} takes a JSON object of arguments, e.g. {{\"{key}\": \"...\"}}"
    value = arguments.get(key)
    if value is None and len(arguments) == 1:
        value = next(iter(arguments.values()))
    if not isinstance(value, str):
        return None, f"Error: {tool} needs a string argument \"{key}\""
    return value, None


# ----------------------------------------------------------------------------- calculator

def calculate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression (safe_arithmetic's grammar plus unary +/-, decimal
    literals and bounded integer powers: `rewards.arithmetic.evaluate(expr, extended=True)`); ValueError
    (with the reason) for anything else."""
    return evaluate(expr, extended=True)[0]


def format_number(value: Fraction) -> str:
    """An exact text of `value`: an integer, a finite decimal (7/4 -> 1.75), or `p/q` (1/3)."""
    if value.denominator == 1:
        return str(value.numerator)
    d, twos, fives = value.denominator, 0, 0
    while d % 2 == 0:
        d, twos = d // 2, twos + 1
    while d % 5 == 0:
        d, fives = d // 5, fives + 1
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    digits = str(scaled).rjust(places + 1, "0")
    return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]


@dataclasses.dataclass
class Calculator:
    """Exact arithmetic: {"expression": "437*829"} -> "362273". See `calculate` for the grammar."""

    name: str = "calculator"
    description: str = ("Evaluate an arithmetic expression exactly. Supports + - * / ** and parentheses, "
                        "integers and decimals.")
    parameters: dict = dataclasses.field(default_factory=lambda: {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "the expression, e.g. 437*829"}},
        "required": ["expression"],
    })

    def call(self, arguments: dict) -> str:
        expr, error = _string_argument(arguments, "expression", self.name)
        if error:
            return error
        try:
            return format_number(calculate(expr))
        except ValueError as err:
            return f"Error: {err}"


# ----------------------------------------------------------------------------- python

@dataclasses.dataclass(frozen=True)
class PythonResult:
    """What one run gave: `status` is "ok", "error" (non-zero exit, e.g. an exception), "timeout",
    "memory" or "killed" (a signal, e.g. the CPU limit); `text` is what the model sees."""

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    text: str


def _truncate(s: str, limit: int) -> str:
    return s if len(s) <= limit else s[:limit] + f"\n... [truncated: {len(s) - limit} more characters]"


@dataclasses.dataclass
class PythonTool:
    """Runs {"code": "..."} in `posttrain.sandbox` (an OS boundary with limits; see that module) and
    returns its stdout (then its stderr, if any), or an "Error: ..." text on a timeout, the memory or
    CPU limit, or a non-zero exit (with the traceback)."""

    timeout_s: float = 5.0  # wall-clock seconds before everything the program started is killed
    memory_mb: int = 512  # RLIMIT_AS of the child (virtual memory, so leave room for the interpreter)
    cpu_s: int | None = None  # RLIMIT_CPU seconds; None: ceil(timeout_s) + 1
    max_output_chars: int = 2000  # stdout + stderr characters returned to the model
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file (also stdout / stderr) the child may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    sandbox: str = "auto"  # the boundary: auto, bwrap, uid or unsafe_inprocess_guard (posttrain.sandbox)
    python: str = sys.executable  # the interpreter to run (its folders are bound read-only)
    name: str = "python"
    description: str = ("Run a Python program and return what it prints. No network, no files outside its "
                        "own folder, limited time and memory.")
    parameters: dict = dataclasses.field(default_factory=lambda: {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print() the results"}},
        "required": ["code"],
    })

    def __post_init__(self):
        if not (self.timeout_s > 0 and self.memory_mb > 0 and self.max_output_chars > 0 and self.max_file_mb > 0):
            raise PosttrainError(f"python tool: timeout_s, memory_mb, max_output_chars and max_file_mb must be "
                                 f"> 0, got {self.timeout_s}, {self.memory_mb}, {self.max_output_chars}, "
                                 f"{self.max_file_mb}")
        self.box = Sandbox(timeout_s=self.timeout_s, memory_mb=self.memory_mb, cpu_s=self.cpu_s,
                           max_file_mb=self.max_file_mb, max_open_files=self.max_open_files,
                           max_output_bytes=4 * self.max_output_chars + 4, mode=self.sandbox, python=self.python)

    def call(self, arguments: dict) -> str:
        code, error = _string_argument(arguments, "code", self.name)
        return error if error else self.run(code).text

    def run(self, code: str) -> PythonResult:
        """Run `code` as a program in a fresh sandbox."""
        r = self.box.run({"main.py": code})
        head = self.box.explain(r)
        body = r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr else "")
        if r.status == "ok":
            text = body if body else "(no output)"
        else:
            text = head + ("\n" + body if body else "")
        text = _truncate(text, self.max_output_chars)
        return PythonResult(r.status, r.stdout, r.stderr, r.returncode, r.seconds, text)


# ----------------------------------------------------------------------------- registry

TOOLS: dict[str, type] = {"calculator": Calculator, "python": PythonTool}


def make_tools(spec: Sequence[str] | Mapping[str, Mapping | None] | None) -> dict[str, Tool]:
    """Tools by name from a config's `tools:` section: a list of names (["calculator", "python"]) or a
    mapping name -> keyword arguments ({"python": {"timeout_s": 2}}). Unknown names and bad keywords
    are PosttrainErrors that name them."""
    if spec is None:
        return {}
    items = spec.items() if isinstance(spec, Mapping) else ((name, None) for name in spec)
    tools: dict[str, Tool] = {}
    for name, kwargs in items:
        if name not in TOOLS:
            raise PosttrainError(f"tools: unknown tool {name!r}; the built-in tools are {', '.join(sorted(TOOLS))}")
        fields = {f.name for f in dataclasses.fields(TOOLS[name]) if f.name not in ("name", "parameters")}
        bad = sorted(set(kwargs or {}) - fields)
        if bad:
            raise PosttrainError(f"tools.{name}: unknown setting(s) {bad}; the settings are {sorted(fields)}")
        tools[name] = TOOLS[name](**dict(kwargs or {}))
    return tools


def tool_schemas(tools: Mapping[str, Tool] | Sequence[Tool]) -> list[dict]:
    """The tools in the OpenAI / HF chat-template format:
    [{"type": "function", "function": {"name", "description", "parameters"}}, ...]."""
    values = tools.values() if isinstance(tools, Mapping) else tools
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in values]
