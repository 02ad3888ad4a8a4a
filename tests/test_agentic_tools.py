"""The agentic tools: the calculator is exact and refuses unsafe input; the python tool runs normal
programs and cannot read or write outside its folder, open sockets, start processes, or run past its
time, CPU or memory limits (posttrain/agentic/tools.py, posttrain/sandbox)."""

import socket
import time

import pytest

from posttrain.agentic.tools import TOOLS, Calculator, PythonTool, Tool, calculate, make_tools, tool_schemas
from posttrain.errors import PosttrainError


@pytest.fixture(scope="module")
def py():
    # A wall-time limit far above what these programs take: under the two test workers' load the sandbox's
    # start alone once took over 3 s. The time limits are tested on their own tools below.
    return PythonTool(timeout_s=30.0, memory_mb=512, max_output_chars=4000)


# ----------------------------------------------------------------------------- calculator


def test_calculator_is_exact():
    calc = Calculator()
    assert calc.call({"expression": "437*829"}) == "362273"
    assert calc.call({"expression": "123456789*987654321"}) == str(123456789 * 987654321)
    assert calc.call({"expression": "4821+7730+1956+3307"}) == "17814"
    assert calc.call({"expression": "0.1+0.2"}) == "0.3"  # exact, not 0.30000000000000004
    assert calc.call({"expression": "7/4"}) == "1.75"
    assert calc.call({"expression": "1/3"}) == "1/3"
    assert calc.call({"expression": "(2+3)*-4"}) == "-20"
    assert calc.call({"expression": "2**10 - 2**-1"}) == "1023.5"
    assert calc.call({"expression": "99**20"}) == str(99**20)
    assert calc.call({"expr": "6*7"}) == "42"  # a single misnamed argument is accepted


@pytest.mark.parametrize("expr", [
    '__import__("os").system("true")', "a+1", "2**100", "9**9**9", "2**0.5", "1/0", "(1", "1e5",
    "[1]*3", "1" + "+1" * 150, "", "(((((((((((((((((((((1)))))))))))))))))))))" * 10,
])
def test_calculator_refuses_unsafe_or_bad_input(expr):
    out = Calculator().call({"expression": expr})
    assert out.startswith("Error:"), (expr, out)
    with pytest.raises(ValueError):
        calculate(expr)


def test_calculator_bad_arguments_are_error_texts():
    calc = Calculator()
    assert calc.call({}).startswith("Error:")
    assert calc.call({"expression": 5}).startswith("Error:")
    assert calc.call("1+1").startswith("Error:")  # not a dict


def test_registry_and_schemas():
    tools = make_tools({"calculator": None, "python": {"timeout_s": 2}})
    assert sorted(tools) == sorted(TOOLS) and tools["python"].timeout_s == 2
    assert all(isinstance(t, Tool) for t in tools.values())
    schemas = tool_schemas(tools)
    assert [s["function"]["name"] for s in schemas] == ["calculator", "python"]
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]
    assert list(make_tools(["calculator"])) == ["calculator"]
    with pytest.raises(PosttrainError, match="unknown tool 'shell'"):
        make_tools(["shell"])
    with pytest.raises(PosttrainError, match="timeout"):
        make_tools({"python": {"timeout": 2}})


# ----------------------------------------------------------------------------- python: normal use


def test_python_runs_normal_code(py):
    r = py.run("import math, json\nprint(math.factorial(20))\nprint(json.dumps({'a': 2**70}))\n"
               "open('notes.txt', 'w').write('kept in my folder')\nprint(open('notes.txt').read())\n"
               "from pathlib import Path\nPath('p.txt').write_text('x')\nprint(Path('p.txt').read_text())")
    assert r.status == "ok", r.text
    assert r.text == f"{math_factorial_20()}\n{{\"a\": {2**70}}}\nkept in my folder\nx\n"
    assert py.call({"code": "print(6 * 7)"}) == "42\n"
    assert py.call({"code": "x = 1"}) == "(no output)"


def math_factorial_20():
    import math

    return math.factorial(20)


def test_python_errors_and_output_limit(py):
    r = py.run("def f():\n    raise ValueError('bad value')\nf()")
    assert r.status == "error" and r.text.startswith("Error: the program exited with status 1")
    assert "ValueError: bad value" in r.text and 'File "main.py", line 2' in r.text
    assert "_sandbox_child" not in r.text  # the guard's own frames are not shown
    assert py.run("print(").status == "error"
    r = PythonTool(max_output_chars=100).run("print('x' * 100000)")
    assert r.status == "ok" and len(r.text) < 200 and "truncated" in r.text


# ----------------------------------------------------------------------------- python: the sandbox


def test_python_cannot_read_outside_its_folder(py, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-42")
    code = f"""
import os, pathlib, builtins
def attempt(label, fn):
    try:
        print(label, 'LEAK', fn())
    except OSError as e:  # refused by the guard, or not there: the host's files are outside the namespace
        print(label, 'blocked')
attempt('passwd', lambda: open('/etc/passwd').read())
attempt('secret', lambda: open({str(secret)!r}).read())
attempt('pathlib', lambda: pathlib.Path({str(secret)!r}).read_text())
attempt('os.open', lambda: os.read(os.open({str(secret)!r}, os.O_RDONLY), 100))
attempt('relative', lambda: open('../' * 30 + {str(secret)[1:]!r}).read())
attempt('listdir', lambda: os.listdir({str(tmp_path)!r}))
attempt('symlink', lambda: os.symlink({str(secret)!r}, 'link'))
attempt('hardlink', lambda: os.link({str(secret)!r}, 'hard'))
attempt('chdir', lambda: os.chdir('/'))
attempt('write', lambda: open({str(tmp_path / 'planted.txt')!r}, 'w').write('x'))
# tampering with what the guard could use does not help: it bound everything at start
os.lstat = os.readlink = os.getcwd = None
builtins.any = builtins.isinstance = lambda *a: True
class Sneaky(str):
    def startswith(self, *a):
        return True
attempt('tampered', lambda: open(Sneaky({str(secret)!r})).read())
"""
    r = py.run(code)
    assert r.status == "ok", r.text
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    assert lines == {k: "blocked" for k in ("passwd", "secret", "pathlib", "os.open", "relative", "listdir", "symlink",
                                            "hardlink", "chdir", "write", "tampered")}, r.stdout
    assert "TOP-SECRET" not in r.text and not (tmp_path / "planted.txt").exists()


def test_python_cannot_open_sockets(py):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        code = f"""
import socket
for label, fn in [('socket', lambda: socket.socket()),
                  ('connect', lambda: socket.create_connection(('127.0.0.1', {port}), timeout=1)),
                  ('dns', lambda: socket.getaddrinfo('localhost', 80)),
                  ('udp', lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))]:
    try:
        fn()
        print(label, 'OPEN')
    except PermissionError:
        print(label, 'blocked')
"""
        r = py.run(code)
        assert r.status == "ok", r.text
        assert r.stdout.split() == ["socket", "blocked", "connect", "blocked", "dns", "blocked", "udp", "blocked"]
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):  # nothing ever connected
            server.accept()
    finally:
        server.close()


def test_python_cannot_start_processes(py, tmp_path):
    marker = tmp_path / "spawned"
    code = f"""
import os, subprocess, _posixsubprocess
attempts = [('system', lambda: os.system('touch {marker}')),
            ('popen', lambda: subprocess.run(['touch', '{marker}'])),
            ('fork', lambda: os.fork()),
            ('spawn', lambda: os.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})),
            ('exec', lambda: os.execv('/usr/bin/touch', ['touch', '{marker}'])),
            ('raw', lambda: _posixsubprocess.fork_exec()),
            ('kill', lambda: os.kill(os.getppid(), 0))]
for label, fn in attempts:
    try:
        fn()
        print(label, 'RAN')
    except PermissionError:
        print(label, 'blocked')
"""
    r = py.run(code)
    assert r.status == "ok", r.text
    assert r.stdout.split()[1::2] == ["blocked"] * 7, r.stdout
    assert not marker.exists()


def test_python_time_limit_stops_a_busy_loop():
    start = time.monotonic()
    r = PythonTool(timeout_s=1.0).run("print('started', flush=True)\nwhile True:\n    pass")
    assert r.status == "timeout" and r.text.startswith("Error: timed out after 1 s")
    assert "started" in r.text  # partial output is kept
    assert time.monotonic() - start < 3.0


def test_python_cpu_limit_kills_even_if_wall_time_is_long():
    start = time.monotonic()
    r = PythonTool(timeout_s=20.0, cpu_s=1).run("while True:\n    pass")
    assert r.status == "killed" and "CPU-time limit" in r.text
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("code", ["x = bytearray(2 * 1024**3)", "x = []\nwhile True:\n    x.append(bytearray(10**7))"])
def test_python_memory_limit(code):
    # A wall-time limit far above the time the allocation takes, so the memory limit is what must stop it:
    # under the two test workers' load the sandbox's start plus 512 MB of zeroed pages once took over 3 s.
    start = time.monotonic()
    r = PythonTool(timeout_s=30.0, memory_mb=512).run(code)
    assert r.status == "memory" and r.text.startswith("Error: the memory limit (512 MB) was exceeded"), r.text
    assert time.monotonic() - start < 30.0


def test_python_folder_is_fresh_and_removed(py):
    first = py.run("import os\nopen('left.txt', 'w').write('x')\nprint(sorted(os.listdir('.')))")
    assert first.status == "ok" and first.stdout.strip() == "['left.txt']", first.text
    assert py.run("import os\nprint(os.listdir('.'))").stdout.strip() == "[]"  # a fresh folder each run
