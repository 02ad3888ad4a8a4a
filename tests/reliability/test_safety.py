"""Safety (issue #15): model-written code runs only in a limited subprocess, weights and checkpoints never
go through pickle and no remote code runs, and HTTP endpoints bind the loopback address by default.

- `code_tests` (the reward that runs model-written code): right and wrong programs, the wall-time
  limit, the memory limit, a refused socket (a listening socket of this test sees no connection), an
  early `sys.exit(0)`, and the reward reached through GRPO's reward config path.
- Pickle-free: an AST scan of every .py file under posttrain/ (no pickle-family import, no
  `torch.load`, no `np.load` without `allow_pickle=False`, no `trust_remote_code` other than False, no
  `**kwargs` into a transformers `from_pretrained`), reported as FILE:LINE; and functional checks that
  a `.bin` folder is refused and an Orbax checkpoint restores with unpickling made impossible.
- Binding: the Prometheus exporter listens on 127.0.0.1 with the default config (not reachable on
  another address of this machine) and on the configured host otherwise; a multi-process run whose
  coordinator address is a loopback one binds JAX's coordinator service there, not every interface.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import pickle
import re
import select
import socket
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

from posttrain.errors import PosttrainError
from posttrain.rewards.functions import code_tests, code_tests_reward, completion_code
from posttrain.rewards.runner import score

PACKAGE = Path(__file__).resolve().parents[2] / "posttrain"
ADD = "def add(a, b):\n    return a + b\n"
ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


# ----------------------------------------------------------------------------- code_tests: the sandbox


def test_code_tests_right_wrong_and_missing_tests():
    fenced = f"Here is my solution:\n```python\n{ADD}```\nDone."
    wrong = "```py\ndef add(a, b):\n    return a - b\n```"
    out = code_tests(prompts=["p"] * 5, completions=[ADD, fenced, wrong, "not python at all", ADD],
                     tests=[ADD_TESTS] * 4 + ["  "])
    assert out == [1.0, 1.0, 0.0, 0.0, None]
    with pytest.raises(PosttrainError, match="'tests'"):
        code_tests(prompts=["p"], completions=[ADD], answer=["3"])


# Programs that game a comparison made by calling the model's objects (issue #34), beside honest ones
# that must still pass: (code, tests, expected reward).
GAMING = {
    "eq_always_true": ("class A:\n    def __eq__(s, o): return True\n    def __ne__(s, o): return False\n"
                       "def add(a, b): return A()\n", ADD_TESTS, 0.0),
    "sub_returns_zero": ("class A:\n    def __sub__(s, o): return 0.0\ndef f(x): return A()\n",
                         "assert abs(f(1) - 3.0) < 1e-9\n", 0.0),
    "bool_always_true": ("class T:\n    def __bool__(s): return True\ndef even(n): return T()\n",
                         "assert even(3)\n", 0.0),
    "str_subclass": ("class S(str):\n    def __eq__(s, o): return True\ndef f(): return S('no')\n",
                     "assert f() == 'yes'\n", 0.0),
    "shadowed_len": ("len = lambda x: 3\ndef f(): return [1]\n", "assert len(f()) == 3\n", 0.0),
    "forged_record": ("def add(a, b): return 0\n"
                      "print('#posttrain-' + '0' * 32 + ' {\"records\": [], \"error\": null}')\n", ADD_TESTS, 0.0),
    "honest_abs": ("def f(x): return 3.0\n", "assert abs(f(1) - 3.0) < 1e-9\n", 1.0),
    "honest_loop": (ADD, "for i in range(5):\n    assert add(i, i) == 2 * i\n", 1.0),
    "honest_humaneval": (ADD, "def check(candidate):\n    assert candidate(2, 3) == 5\ncheck(add)\n", 1.0),
    "honest_method": ("class Solution:\n    def twice(self, x): return 2 * x\n",
                      "assert Solution().twice(4) == 8\n", 1.0),
    "honest_tuple_and_generator": ("def f(): return (1, 2)\ndef g(n):\n    yield from range(n)\n",
                                   "assert f() == (1, 2)\nassert f() != [1, 2]\nassert list(g(3)) == [0, 1, 2]\n", 1.0),
    "honest_truthiness": ("def even(n): return n % 2 == 0\n", "assert even(4)\nassert not even(3)\n", 1.0),
}


def test_code_tests_compares_plain_data_so_objects_cannot_game_the_asserts():
    names = list(GAMING)
    reward = code_tests_reward(workers=2)
    out = reward(prompts=["p"] * len(names), completions=[GAMING[n][0] for n in names],
                 tests=[GAMING[n][1] for n in names])
    assert dict(zip(names, out)) == {n: GAMING[n][2] for n in names}
    # Control: run as plain asserts in the sandbox, the gaming programs pass (the old check would have paid them).
    for name in ("eq_always_true", "sub_returns_zero", "bool_always_true", "str_subclass"):
        code, tests, _ = GAMING[name]
        assert reward.box.run({"main.py": code + tests}).status == "ok", name


def test_completion_code_takes_the_last_python_block_or_the_whole_text():
    assert completion_code("x = 1") == "x = 1"
    assert completion_code("```python\na = 1\n```\nthen\n```python\nb = 2\n```") == "b = 2\n"
    assert completion_code([{"role": "assistant", "content": "```py\nc = 3\n```"}]) == "c = 3\n"


def test_code_tests_an_early_exit_does_not_pass():
    # exit(0) before the tests run: the process exits 0, but the tests never ran.
    wrong = "def add(a, b):\n    return 0\n"
    hacks = [wrong + "import sys\nsys.exit(0)\n", wrong + "import os\nos._exit(0)\n",
             wrong + "import atexit, os\natexit.register(lambda: os._exit(0))\n"]  # exits 0 after the failed assert
    reward = code_tests_reward()
    assert reward(prompts=["p"] * 3, completions=hacks, tests=[ADD_TESTS] * 3) == [0.0, 0.0, 0.0]
    # The exit status alone would have passed them: the check after the tests is what fails them.
    assert [reward.box.run({"main.py": h + ADD_TESTS}).status for h in hacks] == ["ok"] * 3


def test_code_tests_time_limit_stops_endless_programs():
    reward = code_tests_reward(timeout_s=1.0, workers=2)
    start = time.monotonic()
    out = reward(prompts=["p"] * 2, completions=["while True:\n    pass\n", "import time\ntime.sleep(60)\n"],
                 tests=["assert True"] * 2)
    elapsed = time.monotonic() - start
    assert out == [0.0, 0.0]
    assert elapsed < 1.0 + 3.0, f"two 1 s programs took {elapsed:.1f} s: the wall-time limit did not stop them"


def test_code_tests_memory_limit_fails_the_program_not_this_process():
    reward = code_tests_reward(memory_mb=256)
    at_once = "x = bytearray(8 * 2**30)\n"  # 8 GB in one allocation
    growing = "xs = []\nwhile True:\n    xs.append(bytearray(2**24))\n"  # 16 MB at a time, past 256 MB
    out = reward(prompts=["p"] * 3, completions=[at_once, growing, ADD], tests=[ADD_TESTS] * 3)
    assert out == [0.0, 0.0, 1.0]  # the next row in the same batch is scored as usual
    for program in (at_once, growing):  # and 0.0 is the memory limit's doing, not some other failure
        result = reward.box.run({"main.py": program + ADD_TESTS})
        assert result.status == "memory", result.stderr


def test_code_tests_refuses_network_and_the_listener_sees_no_connection():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        srv.setblocking(False)
        port = srv.getsockname()[1]
        program = (ADD + "import socket\n"
                   f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'leak')\n")
        reward = code_tests_reward()
        assert reward(prompts=["p"], completions=[program], tests=[ADD_TESTS]) == [0.0]
        result = reward.box.run({"main.py": program})
        assert result.status == "error" and "sandbox: network access is not allowed" in result.stderr, result.stderr
        readable, _, _ = select.select([srv], [], [], 0.5)
        assert readable == [], "the sandboxed program reached the listening socket"
        # Control: a connection from this process is seen, so the check above can fail.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            readable, _, _ = select.select([srv], [], [], 2.0)
            assert readable == [srv]


def test_code_tests_through_the_reward_config_path():
    from posttrain.rewards.registry import reward_functions
    from posttrain.trainers.grpo import GRPOSection

    section = GRPOSection(rewards={"posttrain.rewards.functions:code_tests": 2.0})
    funcs, weights = reward_functions(section, None)
    rewards, keep, stats = score(funcs, weights, ["p"] * 3, [ADD, "def add(a, b):\n    return 0\n", ADD],
                                 {"tests": [ADD_TESTS, ADD_TESTS, None]}, timeout_s=60.0)
    assert rewards[:2, 0].tolist() == [1.0, 0.0] and np.isnan(rewards[2, 0]) and keep.all()
    assert stats["rewards/code_tests/errors"] == 0 and stats["reward"] == 1.0  # weighted: (2 + 0) / 2


def test_code_tests_by_its_bare_name():
    from posttrain.rewards.registry import reward_functions
    from posttrain.trainers.grpo import GRPOSection

    funcs, _ = reward_functions(GRPOSection(rewards={"code_tests": 1.0}), None)
    assert funcs[0](prompts=["p"], completions=[ADD], tests=[ADD_TESTS]) == [1.0]


# ----------------------------------------------------------------------------- no pickle, no remote code

PICKLE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "shelve"}
UNPICKLING_CALLS = {"torch.load", "torch.serialization.load", "pandas.read_pickle", "yaml.unsafe_load"}
NUMPY_LOADS = {"numpy.load", "jax.numpy.load"}
REMOTE_CODE_TEXT = re.compile(r"""trust_remote_code['"]?\s*[=:]\s*True""")


def _is_false(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def scan_source(source: str, filename: str) -> tuple[list[str], list[str]]:
    """(hits as "FILE:LINE: what", transformers from_pretrained calls as "FILE:LINE") of one file."""
    tree = ast.parse(source, filename)
    hits, hf_calls, aliases = [], [], {}

    def hit(node, what):
        hits.append(f"{filename}:{node.lineno}: {what}")

    for node in ast.walk(tree):  # first pass: what each imported name stands for
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in PICKLE_MODULES:
                    hit(node, f"import {a.name}")
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in PICKLE_MODULES:
                hit(node, f"from {node.module} import ...")
            for a in node.names:
                if a.name in PICKLE_MODULES:
                    hit(node, f"from {node.module} import {a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def dotted(expr) -> str | None:
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return None
        return ".".join([aliases.get(expr.id, expr.id), *reversed(parts)])

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "trust_remote_code" and not _is_false(v):
                    hit(node, "'trust_remote_code' key not False")
        if not isinstance(node, ast.Call):
            continue
        name = dotted(node.func) or ""
        kw = {k.arg: k.value for k in node.keywords}
        if "trust_remote_code" in kw and not _is_false(kw["trust_remote_code"]):
            hit(node, f"{name or 'a call'}(trust_remote_code=...) not False")
        if name in UNPICKLING_CALLS:
            hit(node, f"{name}() unpickles")
        if name in ("importlib.import_module", "__import__") and node.args and \
                isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in PICKLE_MODULES:
            hit(node, f"{name}({node.args[0].value!r})")
        if name == "yaml.load" and not (isinstance(kw.get("Loader"), (ast.Attribute, ast.Name)) and
                                        (dotted(kw["Loader"]) or "").endswith("SafeLoader")):
            hit(node, "yaml.load without a SafeLoader")
        if name in NUMPY_LOADS:
            if "allow_pickle" not in kw or not _is_false(kw["allow_pickle"]):  # said, not left to the default
                hit(node, f"{name} without allow_pickle=False")
        if name.startswith("transformers.") and name.endswith(".from_pretrained"):
            hf_calls.append(f"{filename}:{node.lineno}")
            if None in kw:
                hit(node, f"{name}(**kwargs) could pass trust_remote_code")
    for lineno, line in enumerate(source.splitlines(), 1):  # comments and strings too
        if REMOTE_CODE_TEXT.search(line):
            hits.append(f"{filename}:{lineno}: trust_remote_code True in the text")
    return hits, hf_calls


def test_scanner_reports_each_kind_of_hit_with_its_line():
    bad = ("import pickle\n"
           "from joblib import load\n"
           "import numpy as np\n"
           "import torch\n"
           "from transformers import AutoModel\n"
           "torch.load('x.bin')\n"
           "np.load('x.npy', allow_pickle=True)\n"
           "AutoModel.from_pretrained('m', trust_remote_code=True)\n"
           "AutoModel.from_pretrained('m', **opts)\n"
           "cfg = {'trust_remote_code': flag}\n"
           "import importlib; importlib.import_module('cloudpickle')\n"
           "np.load('y.npy', allow_pickle=False)\n"
           "AutoModel.from_pretrained('m', local_files_only=True)\n"
           "np.load('z.npy')\n")
    hits, hf_calls = scan_source(bad, "bad.py")
    lines = sorted({int(h.split(":")[1]) for h in hits})
    assert lines == [1, 2, 6, 7, 8, 9, 10, 11, 14], hits  # imports of numpy / torch / transformers, lines 12-13 fine
    assert all(re.match(r"bad\.py:\d+: ", h) for h in hits)
    assert hf_calls == ["bad.py:8", "bad.py:9", "bad.py:13"]


def test_posttrain_has_no_pickle_and_no_remote_code():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, f"only {len(files)} files under {PACKAGE}"
    hits, hf_calls = [], []
    for f in files:
        h, c = scan_source(f.read_text(encoding="utf-8"), str(f.relative_to(PACKAGE.parent)))
        hits += h
        hf_calls += c
    assert not hits, "unsafe loading in posttrain/:\n" + "\n".join(hits)
    # Not vacuous: the scan sees the config and tokenizer loads (AutoConfig, AutoTokenizer).
    assert len(hf_calls) >= 2, hf_calls


class _Unpickling:
    """Records every global an unpickler resolves (the `pickle.find_class` audit event: the C and Python
    unpicklers, torch.load, numpy all raise it) while `active`. One audit hook for the whole process."""

    active = False
    seen: list = []
    installed = False

    @classmethod
    def install(cls):
        if not cls.installed:
            sys.addaudithook(lambda event, args: cls.seen.append(args)
                             if cls.active and event == "pickle.find_class" else None)
            cls.installed = True


@contextlib.contextmanager
def refused_unpickling(monkeypatch):
    """Inside: pickle.load / pickle.loads and torch.load raise, and every global an unpickler resolves is
    recorded (the list yielded). Enter it after a warm-up call, so that no module imported for the first
    time inside keeps a reference to the raising stand-ins (pickle.Unpickler itself is left alone, as
    libraries subclass it at import; the audit hook covers it)."""
    def refuse(*_a, **_k):
        raise AssertionError("unpickling was attempted")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    if "torch" in sys.modules:
        monkeypatch.setattr(sys.modules["torch"], "load", refuse)
    _Unpickling.install()
    _Unpickling.seen.clear()
    _Unpickling.active = True
    try:
        yield _Unpickling.seen
    finally:
        _Unpickling.active = False
        monkeypatch.undo()


def _bin_folder(path: Path) -> Path:
    import torch  # a test prerequisite `make test` installs: missing is a failure, not a skip

    from posttrain.models.config import preset
    from posttrain.models.hf_config import config_to_hf

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config_to_hf(preset("demo-tiny"))))
    torch.save({"model.embed_tokens.weight": torch.zeros(4, 4)}, path / "pytorch_model.bin")
    return path


def test_audit_hook_sees_unpickling():
    # The control: unpickling a global is recorded, so an empty record below means none happened.
    _Unpickling.install()
    _Unpickling.seen.clear()
    _Unpickling.active = True
    try:
        pickle.loads(pickle.dumps(Path("x")))
    finally:
        _Unpickling.active = False
    assert _Unpickling.seen


def test_bin_checkpoint_is_refused_without_unpickling(tmp_path, monkeypatch):
    from posttrain.models import from_pretrained

    folder = _bin_folder(tmp_path / "bin_only")
    with pytest.raises(PosttrainError):  # warm-up: imports what loading needs
        from_pretrained(str(folder))
    with refused_unpickling(monkeypatch) as unpickled:
        with pytest.raises(PosttrainError, match="safetensors checkpoints only"):
            from_pretrained(str(folder))
        # An index that names the .bin file: read as safetensors, refused, still never unpickled.
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}}))
        with pytest.raises(PosttrainError, match="not a readable safetensors file"):
            from_pretrained(str(folder))
    assert unpickled == []


def test_orbax_checkpoint_restores_without_unpickling(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from posttrain.train.checkpoint import Checkpointer

    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(7)}
    ck = Checkpointer(str(tmp_path / "ck"), keep=2, async_save=False)
    try:
        ck.save(1, state, {"position": 5}, {"note": "x"})
        ck.save(2, state, {"position": 6}, {"note": "y"})
        ck.restore(1, state)  # warm-up
        with refused_unpickling(monkeypatch) as unpickled:
            restored, data, meta = ck.restore(2, state)
    finally:
        ck.close()
    assert np.array_equal(restored["w"], state["w"]) and int(restored["step"]) == 7
    assert data == {"position": 6} and meta == {"note": "y"}
    assert unpickled == []
    assert not [p for p in (tmp_path / "ck").rglob("*") if p.suffix in (".pkl", ".pickle")]


# ----------------------------------------------------------------------------- binding


def _other_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def test_prometheus_binds_loopback_by_default(tmp_path):
    from posttrain.config import MetricsSection
    from posttrain.train.metrics import make_sinks

    section = MetricsSection(sinks=("prometheus",), prometheus_port=0)
    assert section.prometheus_host == "127.0.0.1"
    (sink,) = make_sinks(section, tmp_path / "run")
    try:
        host, port = sink._server.socket.getsockname()[:2]
        assert host == "127.0.0.1", f"the exporter listens on {host!r}"
        other = _other_address()
        if other is not None:  # not reachable on the machine's other address
            with pytest.raises(OSError):
                socket.create_connection((other, port), timeout=2).close()
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        sink.close()


def test_prometheus_binds_the_configured_host(tmp_path):
    from posttrain.config import MetricsSection
    from posttrain.train.metrics import make_sinks

    (sink,) = make_sinks(MetricsSection(sinks=("prometheus",), prometheus_host="127.0.0.2", prometheus_port=0),
                         tmp_path / "run")
    try:
        assert sink._server.socket.getsockname()[0] == "127.0.0.2"
    finally:
        sink.close()


def test_distributed_coordinator_binds_loopback_for_a_loopback_address(monkeypatch):
    import posttrain.sharding as S

    seen = {}
    fake = types.SimpleNamespace(
        distributed=types.SimpleNamespace(is_initialized=lambda: False, initialize=lambda **k: seen.update(k)),
        config=types.SimpleNamespace(jax_cpu_collectives_implementation="gloo", update=lambda *a: None))
    monkeypatch.setattr(S, "jax", fake)
    monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
    for key, value in (("JAX_COORDINATOR_ADDRESS", "127.0.0.1:12345"), ("JAX_NUM_PROCESSES", "2"),
                       ("JAX_PROCESS_ID", "0")):
        monkeypatch.setenv(key, value)
    assert S.init_distributed()
    # JAX's rule (jax/_src/distributed.py): the argument, else the environment variable, else [::]:port.
    bind = seen.get("coordinator_bind_address") or os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or "[::]:12345"
    assert bind.rsplit(":", 1)[0] in ("127.0.0.1", "localhost", "[::1]"), bind
