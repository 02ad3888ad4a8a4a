"""Escape attempts against posttrain.sandbox, as a model optimised on code rewards would try them (issue #34).

Each attempt is a program run through the public API (`Sandbox.run`) twice: as configured (bubblewrap
plus the Python guard) and with the Python guard off (`guard=False`), so the OS boundary is shown to
hold on its own (the guard is bypassable: attempt `guard_closure_rewrite` is a working bypass of it).
Success is judged on this side wherever it can be: a planted file that must not exist, a canary text
that must not come back, a victim process of this user that must stay alive and untraced, listeners
that must see nothing, the process table that must hold no leftover of the run, host sysctls that must not
change, this process's inotify instances that must stay available; where only the program can tell (a call that
must fail, EPERM from the seccomp filter when the guard is off, bytes and files a fill managed, the host uid it
runs as) its own report is read. Issue #54 added the attempts after `become_root`, and a second run of every
attempt with the trainer an unprivileged user. The tables printed (`pytest -s`) are what docs/security.md counts.
The attempts themselves (programs, syscall numbers, which labels must fail): escape_attempts.py beside this file.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from escape_attempts import ATTEMPTS, MUST_EPERM, MUST_FAIL, PRELUDE, SYSCALLS, SYSCTLS

import posttrain.sandbox as S
from posttrain.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"  # the unprivileged trainer's interpreter (root's pyenv under /root is unreadable)
LIMITS = dict(timeout_s=3.0, memory_mb=256, max_file_mb=16, disk_mb=32, max_inodes=4096, max_processes=16)


def _prerequisites() -> None:
    """bubblewrap and libseccomp's bindings are installed by `make setup`: missing, the test fails (never skips)."""
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is missing: make setup installs it")
    S._seccomp_program()  # PosttrainError (a failure) without libseccomp's Python bindings


def _keyctl(*args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYSCALLS["keyctl"], *args)


def _sysctls() -> dict:
    return {p: open(f"/proc/sys/{p}").read() for p in SYSCTLS if p != "vm/drop_caches"}


def _host(tmp, uid=None):
    """The host side: canaries, listeners, a key in this process's session keyring (its description and payload
    hold the canary) and a victim process. With `uid` (the unprivileged run) the folder, the secret and the victim
    belong to that uid: the sandbox, running as that uid, would reach them if its boundary failed."""
    canary = "CANARY-" + secrets.token_hex(8)
    secret = tmp / "secret.txt"
    secret.write_text(canary)
    secret.chmod(0o600)
    os.environ["POSTTRAIN_ESCAPE_CANARY"] = canary  # in this process's environ, for the environ attempts
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    unix_path = str(tmp / "sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    unix.listen(8)
    unix.setblocking(False)
    abstract = "\0posttrain-escape-" + secrets.token_hex(4)
    unix_abs = socket.socket(socket.AF_UNIX)
    unix_abs.bind(abstract)
    unix_abs.listen(8)
    unix_abs.setblocking(False)
    libc = ctypes.CDLL(None, use_errno=True)
    desc = f"posttrain-escape-{canary}".encode()
    key = libc.syscall(SYSCALLS["add_key"], b"user", desc, canary.encode(), len(canary), -3)  # @s
    drop = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    if uid is not None:
        for path in (tmp, secret):
            os.chown(path, uid, uid)
        os.chmod(unix_path, 0o777)
    victim = subprocess.Popen([*drop, "sleep", "600"])
    return dict(tmp=tmp, canary=canary, secret=secret, tcp=tcp, udp=udp, unix=unix, unix_abs=unix_abs,
                unix_path=unix_path, abstract=abstract, victim=victim, key=max(key, 0), uid=uid,
                sysctls=_sysctls())


def _close_host(h) -> None:
    h["victim"].kill()
    h["victim"].wait()
    for name in ("tcp", "udp", "unix", "unix_abs"):
        h[name].close()
    if h["key"]:
        _keyctl(9, h["key"], -3)  # KEYCTL_UNLINK from the session keyring
    os.environ.pop("POSTTRAIN_ESCAPE_CANARY", None)


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    _prerequisites()
    h = _host(tmp_path_factory.mktemp("escape"))
    try:
        yield h
    finally:
        _close_host(h)


def _processes_with(marker: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(name))
            except OSError:
                pass
    return found


def _victim_ok(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        with open(f"/proc/{pid}/status") as f:
            tracer = [ln for ln in f if ln.startswith("TracerPid:")][0].split()[1]
    except OSError:
        return False
    return state not in ("Z", "X", "t", "T") and tracer == "0"


def _listeners_silent(h) -> list[str]:
    heard = []
    for name in ("tcp", "unix", "unix_abs"):
        try:
            conn, _ = h[name].accept()
            conn.close()
            heard.append(name)
        except BlockingIOError:
            pass
    try:
        h["udp"].recvfrom(64)
        heard.append("udp")
    except BlockingIOError:
        pass
    return heard


def _fields(name: str, guard: bool, h, python: str = sys.executable) -> dict:
    tag = f"{name}-{'g' if guard else 'os'}-{secrets.token_hex(4)}"
    plant = h["tmp"] / f"planted-{tag}"
    plant_name = f"posttrain-planted-{tag}"
    site = sysconfig.get_paths()["purelib"]
    return dict(SECRET=str(h["secret"]), PLANT=str(plant), PLANT_REL=str(plant).lstrip("/"), PLANT_NAME=plant_name,
                VICTIM=h["victim"].pid, PARENT=os.getpid(), MARKER=f"posttrain-escape-{tag}", TMP=str(h["tmp"]),
                SITE=site, PTH=f"{plant_name}.pth", TCP_PORT=h["tcp"].getsockname()[1],
                UDP_PORT=h["udp"].getsockname()[1], UNIX_PATH=h["unix_path"], UNIX_ABSTRACT=h["abstract"],
                SYS=repr(SYSCALLS), HOST_KEY=h["key"], PYTHON=python)


def _program(name: str, fields: dict) -> str:
    return PRELUDE.format(**fields) + ATTEMPTS[name].format(**fields)


def _run_one(name: str, guard: bool, h) -> tuple[str, str, list[str]]:
    """(name, outcome, escapes): outcome is how the run ended; escapes lists what reached the host."""
    fields = _fields(name, guard, h)
    box = Sandbox(**LIMITS, mode="bwrap", guard=guard)
    r = box.run({"main.py": _program(name, fields)})
    return name, _how(r), _escapes(name, guard, h, fields, r, box)


def _escapes(name, guard, h, fields, r, box) -> list[str]:
    """What of the run reached the host, judged on this side (and from the run's own report where only it can say:
    an attempt that must fail printed a result, a fill went past its bound)."""
    plant, plant_name, site = Path(fields["PLANT"]), fields["PLANT_NAME"], fields["SITE"]
    escapes = []
    if plant.exists():
        escapes.append("planted a file outside")
    for where in (os.path.join(site, f"{plant_name}.pth"), f"/usr/{plant_name}",
                  os.path.join(os.path.dirname(box.python), plant_name),
                  os.path.join(os.path.dirname(os.__file__), plant_name)):
        if os.path.exists(where):
            escapes.append(f"wrote {where}")
            os.remove(where)
    if h["canary"] in r.stdout + r.stderr:
        escapes.append("read a host secret, key or the parent's environment")
    if h["secret"].read_text() != h["canary"]:
        escapes.append("changed a host file")
    if not _victim_ok(h["victim"].pid):
        escapes.append("killed, stopped or traced a process of this user")
    deadline = time.monotonic() + 2.0  # a namespace being torn down may take a moment on a loaded machine
    while _processes_with(fields["MARKER"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _processes_with(fields["MARKER"]):
        for pid in _processes_with(fields["MARKER"]):
            os.kill(pid, signal.SIGKILL)
        escapes.append("left a process running")
    if len(r.stdout) > box.max_output_bytes + 200:
        escapes.append(f"returned {len(r.stdout)} bytes of output")
    for line in r.stdout.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0] in MUST_FAIL and parts[1] == "RESULT":
            escapes.append(f"{parts[0]} succeeded: {parts[2][:80]}")
        if not guard and len(parts) == 3 and parts[0] in MUST_EPERM and parts[1] == "REFUSED" \
                and "[Errno 1]" not in parts[2]:
            escapes.append(f"{parts[0]} was not refused by the seccomp filter: {parts[2][:80]}")
        if parts[0] == "filled" and len(parts) == 3:
            folder, total = parts[1], int(parts[2])
            bound = box.disk_mb << 20 if folder == "/tmp" else 0
            if total > bound:
                escapes.append(f"wrote {total >> 20} MB to {folder} (bound {bound >> 20} MB)")
        if parts[0] == "inodes" and int(parts[1]) > box.max_inodes:
            escapes.append(f"made {parts[1]} files (bound {box.max_inodes})")
        if parts[0] == "uid_map" and parts[1] == "RESULT" and h["uid"] is None and os.geteuid() == 0:
            outside = int(re.findall(r"\d+", parts[2])[1])
            if outside == 0 or outside == os.getuid():
                escapes.append(f"ran as the trainer's uid {outside} (uid_map {parts[2]})")
    if name == "inotify_quota":
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(SYSCALLS["inotify_init1"], 0)
        if fd < 0:
            escapes.append("used up this user's inotify instances")
        else:
            os.close(fd)
    if _sysctls() != h["sysctls"]:
        escapes.append("changed a host sysctl")
    return escapes


def _how(r) -> str:
    """How a run ended, for the table: the errors its attempts met (from its own report), or its status."""
    errors = []
    for line in r.stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) >= 3 and parts[1] == "REFUSED" and parts[2] not in errors:
            errors.append(parts[2])
    return r.status if r.status != "ok" or not errors else ",".join(errors)


def _table(rows, h, title: str) -> dict:
    """Print the table (`pytest -s`) and assert: nothing escaped, no listener heard, the victim lives, the bounded
    attempts ended by their limits."""
    heard = _listeners_silent(h)
    table = {}
    for guard, name, status, escapes in rows:
        table.setdefault(name, {})["guard" if guard else "os"] = (status, escapes)
    print(f"\n{title}: {len(ATTEMPTS)} escape attempts x 2 configurations")
    print(f"{'attempt':30} {'bwrap + guard':44} {'bwrap alone':44}")
    for name, cols in table.items():
        cells = [("ESCAPED: " + "; ".join(e)) if e else how for how, e in (cols["guard"], cols["os"])]
        print(f"{name:30} {cells[0]:44} {cells[1]:44}")
    escaped = {(name, col): e for name, cols in table.items() for col, (_, e) in cols.items() if e}
    assert not escaped, escaped
    assert not heard, f"a listener of this host was reached: {heard}"
    assert h["victim"].poll() is None  # the victim, and this process (the trainer's stand-in), still run
    # The limits did their part: the bombs, the fills and the endless programs ended, none ran free.
    for name in ("fork_bomb", "memory_fill", "infinite_output", "leftover_after_time_limit", "ptrace_bwrap_init"):
        for col in ("guard", "os"):
            assert table[name][col][0] in ("timeout", "killed", "memory", "error"), (name, col, table[name][col])
    assert table["guard_closure_rewrite"]["guard"][0] != "ok"  # the attempts ran: they met errors, and said so
    return table


def test_sandbox_escape_attempts_all_fail(host):
    """As this process's user (root in `make test` here): every attempt, with and without the Python guard."""
    assert len(ATTEMPTS) >= 40
    jobs = [(name, guard) for name in ATTEMPTS for guard in (True, False)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        rows = list(pool.map(lambda j: (j[1], *_run_one(j[0], j[1], host)), jobs))
    _table(rows, host, f"as uid {os.geteuid()}")


# The unprivileged trainer: runs the programs it is given through posttrain.sandbox and prints what came back.
HELPER = """
import json, sys
from concurrent.futures import ThreadPoolExecutor
from posttrain.sandbox import Sandbox
jobs, limits = json.load(sys.stdin)
def one(job):
    tag, program, guard = job
    r = Sandbox(**limits, mode="bwrap", guard=guard, python=sys.executable).run({"main.py": program})
    return tag, [r.status, r.stdout, r.stderr, r.returncode, r.seconds, r.backend]
with ThreadPoolExecutor(4) as pool:
    print(json.dumps(dict(pool.map(one, jobs))))
"""


def test_sandbox_escape_attempts_all_fail_for_an_unprivileged_trainer():
    """The same attempts with the trainer an unprivileged user (a fresh uid; Debian's python3 as its interpreter,
    since root's pyenv under /root is closed to it): its folder, secret and victim process are its own, so a
    failing boundary would reach them."""
    _prerequisites()
    if os.geteuid() != 0:
        pytest.skip("this user is unprivileged already: test_sandbox_escape_attempts_all_fail is that run")
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.fail(f"{SYSTEM_PYTHON} is missing: make setup installs it (with python3-seccomp)")
    uid = (2 << 20) + secrets.randbelow(1 << 20)
    folder = Path(tempfile.mkdtemp(prefix="posttrain-escape-unprivileged-"))
    h = _host(folder, uid)
    try:
        jobs, fields = [], {}
        for name in ATTEMPTS:
            for guard in (True, False):
                f = _fields(name, guard, h, SYSTEM_PYTHON)
                fields[f["MARKER"]] = (name, guard, f)
                jobs.append((f["MARKER"], _program(name, f), guard))
        proc = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                               SYSTEM_PYTHON, "-c", HELPER], input=json.dumps([jobs, LIMITS]), capture_output=True,
                              text=True, cwd="/", timeout=900,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(folder)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads(proc.stdout)
        box = Sandbox(**LIMITS, mode="bwrap", python=SYSTEM_PYTHON)
        rows = []
        for tag, (name, guard, f) in fields.items():
            status, stdout, stderr, rc, seconds, backend = results[tag]
            assert backend == "bwrap"
            r = S.SandboxResult(status, stdout, stderr, rc, seconds, backend)
            rows.append((guard, name, _how(r), _escapes(name, guard, h, f, r, box)))
        _table(rows, h, f"as the unprivileged uid {uid}")
    finally:
        _close_host(h)
        shutil.rmtree(folder, ignore_errors=True)


def test_listeners_and_checks_can_see_an_escape(host):
    """Controls: the same checks do see what an unsandboxed program does, so the test above can fail."""
    plant = host["tmp"] / "control-plant"
    subprocess.run(["sh", "-c", f"echo x > {plant}"], check=True)
    assert plant.exists()
    with socket.create_connection(("127.0.0.1", host["tcp"].getsockname()[1]), timeout=2):
        time.sleep(0.2)
        assert "tcp" in _listeners_silent(host)
    marker = "posttrain-escape-control-" + secrets.token_hex(4)
    proc = subprocess.Popen(["sh", "-c", "sleep 1000; true", marker])
    try:
        time.sleep(0.1)
        assert _processes_with(marker) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    tracer = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(tracer.pid, signal.SIGSTOP)
        time.sleep(0.1)
        assert not _victim_ok(tracer.pid)
    finally:
        tracer.kill()
        tracer.wait()
