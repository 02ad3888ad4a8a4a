"""Tools a model can call during an episode: the protocol, the built-ins and their registry.

What it is:
- `Tool`: anything with `name`, `description`, `parameters` (a JSON Schema object of the
  arguments, as HF chat templates' `tools=` and the OpenAI function format expect) and
  `call(arguments: dict) -> str`. A tool never raises for bad model input: it returns an error
  text starting with "Error:", which goes back to the model as the tool's output.
- `Calculator` ("calculator"): exact arithmetic on an expression string. The grammar is
  `rewards.functions.safe_arithmetic`'s (non-negative integers, + - * /, parentheses; parsed with
  `ast`, evaluated with Fractions, never `eval`-ed), extended with unary +/-, decimals and `**`
  with an integer exponent of at most `MAX_EXPONENT` (and a result of at most `MAX_RESULT_BITS`).
- `PythonTool` ("python"): runs a program in a fresh `python -I -B` subprocess in a new
  temporary folder, with a wall-time limit (the process group is killed), an address-space limit
  (RLIMIT_AS; an allocation past it is a MemoryError), a CPU-seconds limit, a file-size limit
  and an audit-hook guard (`_sandbox_child.py`) that refuses sockets, process creation and file
  access outside the folder (reads of the interpreter's own stdlib / site-packages are allowed so
  imports work). stdout and stderr go to files outside the folder and come back truncated to
  `max_output_chars`. The child sets its own limits before the program runs, not the parent's
  `preexec_fn`, which CPython documents as unsafe (it can deadlock) in a threaded parent like JAX.
- `TOOLS` (name -> class), `make_tools(spec)` (names or {name: kwargs}, as a config's `tools:`
  section gives them) and `tool_schemas(tools)` (the list for `apply_chat_template(tools=...)`).

What it is not, and the sandbox's limits (read before exposing the python tool to anything but
your own model's small programs): an audit-hook sandbox is a best-effort guard, NOT a security
boundary. CPython audits only some operations, and native code is not audited at all: a C
extension that is importable from site-packages, a shared library the program writes into its
own folder and loads through `importlib.machinery.ExtensionFileLoader` (dlopen is not audited), a
`marshal` payload that builds malicious bytecode, an interpreter bug, or a fresh copy of an
extension module can read any file or open any socket the OS allows this user. Known gaps besides:
`os.stat` (existence and size of any file) is not refused; descriptor-relative opens (`dir_fd=`)
are checked against the working folder, not the descriptor; there is no limit on threads or on
disk use beyond the file-size limit per file; the process runs as the same OS user (here, often
root). What it is for: keeping a policy model's own small programs (a calculation, a check) from
touching the machine by accident or by naive reward hacking. For untrusted code put an OS
boundary (a container, gVisor, nsjail, a VM) around it as well.

References: Python's audit events table (docs.python.org/3/library/audit_events.html) and
PEP 578 (which itself warns that audit hooks are not a sandbox); Hermes / Qwen / Llama 3
function-calling JSON Schemas for `parameters`.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from posttrain.errors import PosttrainError


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

MAX_EXPONENT = 64  # the largest |exponent| of `**` the calculator accepts
MAX_RESULT_BITS = 4096  # a bound on any intermediate power's numerator/denominator size
_MAX_CHARS = 200  # as safe_arithmetic's bound
_CALC_CHARS = re.compile(r"[0-9 \t+\-*/().]+")
_DECIMAL = re.compile(r"\d+\.?\d*|\.\d+")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def calculate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression (safe_arithmetic's grammar plus unary +/-, decimal
    literals and bounded integer powers); ValueError (with the reason) for anything else."""
    if not isinstance(expr, str) or len(expr) > _MAX_CHARS or not _CALC_CHARS.fullmatch(expr):
        raise ValueError("not an arithmetic expression of numbers, + - * / ** and parentheses")
    source = expr.strip()
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ValueError(f"cannot parse: {getattr(err, 'msg', err)}") from None

    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            literal = ast.get_source_segment(source, node) or ""
            if not _DECIMAL.fullmatch(literal):
                raise ValueError(f"{literal!r} is not a decimal number")
            return Fraction(literal)  # exact: Fraction("0.1") == 1/10
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base, exp = value(node.left), value(node.right)
            if exp.denominator != 1 or abs(exp) > MAX_EXPONENT:
                raise ValueError(f"** needs an integer exponent of at most {MAX_EXPONENT} in size")
            if base == 0 and exp < 0:
                raise ValueError("division by zero")
            bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length()) * abs(int(exp))
            if bits > MAX_RESULT_BITS:
                raise ValueError(f"the result of ** would exceed {MAX_RESULT_BITS} bits")
            return base ** int(exp)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"{type(node).__name__} is not allowed")

    try:
        return value(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


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

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_MEMORY_RC = 3  # the child's exit status after a MemoryError (see _sandbox_child.py)
_SIGNALS = {signal.SIGXCPU: "the CPU-time limit was exceeded", signal.SIGKILL: "the process was killed",
            signal.SIGSEGV: "the process crashed (segmentation fault)", signal.SIGABRT: "the process aborted"}


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
    """Runs {"code": "..."} in a sandboxed subprocess (see the module docstring and its limits) and
    returns its stdout (then its stderr, if any), or an "Error: ..." text on a timeout, the memory or
    CPU limit, or a non-zero exit (with the traceback)."""

    timeout_s: float = 5.0  # wall-clock seconds before the process group is killed
    memory_mb: int = 512  # RLIMIT_AS of the child (virtual memory, so leave room for the interpreter)
    cpu_s: int | None = None  # RLIMIT_CPU seconds; None: ceil(timeout_s) + 1
    max_output_chars: int = 2000  # stdout + stderr characters returned to the model
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file (also stdout / stderr) the child may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    python: str = sys.executable  # the interpreter to run (its stdlib / site-packages are readable)
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

    def call(self, arguments: dict) -> str:
        code, error = _string_argument(arguments, "code", self.name)
        return error if error else self.run(code).text

    def run(self, code: str) -> PythonResult:
        """Run `code` as a program in a fresh temporary folder (deleted afterwards)."""
        cpu = self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1
        with tempfile.TemporaryDirectory(prefix="posttrain-python-", ignore_cleanup_errors=True) as outer:
            work = os.path.join(outer, "work")
            os.mkdir(work, 0o700)
            with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
                f.write(code)
            env = {"PATH": os.defpath, "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8",
                   "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            argv = [self.python, "-I", "-B", "-u", _CHILD, work, str(self.memory_mb * 2**20), str(cpu),
                    str(self.max_file_mb * 2**20), str(self.max_open_files)]
            # stdout/stderr are files outside the working folder: the child cannot open them by path, and
            # the parent never buffers more than it returns (a pipe would hold all a print loop writes).
            with open(os.path.join(outer, "stdout"), "w+b") as out, open(os.path.join(outer, "stderr"), "w+b") as err:
                start = time.monotonic()
                proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        start_new_session=True, close_fds=True)
                timed_out = not _wait_unreaped(proc.pid, start + self.timeout_s)
                _kill_group(proc)  # before reaping: the group id cannot belong to anyone else yet
                rc = None if timed_out else proc.wait()
                proc.wait()
                seconds = time.monotonic() - start
                stdout, stderr = (_read_head(fh, self.max_output_chars) for fh in (out, err))
        return self._result(rc, timed_out, stdout, stderr, seconds)

    def _result(self, rc, timed_out, stdout, stderr, seconds) -> PythonResult:
        if timed_out:
            status = "timeout"
            head = f"Error: timed out after {self.timeout_s:g} s (wall-time limit); the process was killed."
        elif rc == 0:
            status, head = "ok", ""
        elif rc == _MEMORY_RC and "the memory limit" in stderr:
            status, head = "memory", f"Error: the memory limit ({self.memory_mb} MB) was exceeded."
        elif rc is not None and rc < 0:
            sig = -rc
            status = "killed"
            head = f"Error: {_SIGNALS.get(sig, f'the process was killed by signal {sig}')}."
        else:
            status, head = "error", f"Error: the program exited with status {rc}."
        body = stdout + (("\n" if stdout and not stdout.endswith("\n") else "") + stderr if stderr else "")
        if status == "ok":
            text = body if body else "(no output)"
        else:
            text = head + ("\n" + body if body else "")
        return PythonResult(status, stdout, stderr, rc, seconds, _truncate(text, self.max_output_chars))


def _wait_unreaped(pid: int, deadline: float) -> bool:
    """Wait until the child exits or `deadline` (time.monotonic) passes, without reaping it (WNOWAIT), so
    its pid, which is also its process group's id, stays taken until the group has been killed. True if
    it exited."""
    delay = 0.001
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(delay, deadline - now))
        delay = min(delay * 2, 0.02)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it leads its own session): anything it left running dies too."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_head(fh, max_chars: int) -> str:
    """The start of a file the child wrote: at most ~4 * max_chars bytes are read (the caller truncates
    to characters), with a note of the full size when there was more."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    raw = fh.read(4 * max_chars + 4)
    data = raw.decode("utf-8", errors="replace")
    return data if len(raw) == size else data + f"\n... [truncated: {size} bytes in all]"


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
