"""posttrain.sandbox: the boundary chosen per machine, the fallbacks, and the uid fallback's own boundary."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import time

import pytest

import posttrain.sandbox as S
from posttrain.errors import PosttrainError
from posttrain.sandbox import Sandbox, resolve_mode

SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def fresh_modes():
    resolve_mode.cache_clear()
    yield
    resolve_mode.cache_clear()


def test_auto_prefers_bwrap_and_the_program_runs_in_its_own_namespaces():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is missing: make setup installs it")
    r = Sandbox(guard=False).run({"main.py": "import os\nprint(os.getpid(), os.getuid(), sorted(os.listdir('/')))"})
    pid, uid, root = r.stdout.split(" ", 2)
    assert r.backend == "bwrap" and r.status == "ok"
    assert int(pid) <= 3 and uid == "65534"  # its own PID namespace, no host uid
    # No host folder but the read-only binds (system, interpreter) and its own /proc, /dev, /tmp, /sandbox.
    interpreter = {d.split("/")[1] for d in S._python_dirs(S.sys.executable)}
    assert set(ast.literal_eval(root)) <= {"bin", "dev", "lib", "lib32", "lib64", "proc", "sbin", "tmp", "usr",
                                            "sandbox"} | interpreter, root
    assert "etc" not in interpreter and "home" not in ast.literal_eval(root)


def test_a_fork_bomb_gets_max_processes_tasks_and_leaves_none_behind(monkeypatch):
    """The run's processes and threads are capped at max_processes, as root too (there the kernel skips
    RLIMIT_NPROC for a user namespace that root owns: a pids cgroup caps the run; before it, a fork bomb filled the
    host's PID table, ~29 000 tasks, and other processes failed to fork); nothing of the run is left after it."""
    made = []  # this run's cgroups (other test workers' sandboxes make their own at the same time)
    monkeypatch.setattr(S, "make_cgroups", lambda *a, real=S.make_cgroups: made.extend(real(*a)) or made)
    code = ("import os, time\nn = 0\ntry:\n    while n < 5000:\n        if os.fork() == 0:\n"
            "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
            "except OSError as e:\n    print(n, e.errno, flush=True)\n")
    r = Sandbox(guard=False, timeout_s=10.0, max_processes=16).run({"main.py": code})
    n, errno = r.stdout.split()
    assert r.backend == "bwrap" and 0 < int(n) < 16 and int(errno) == 11, r  # EAGAIN at the cap
    if os.geteuid() == 0 and os.path.isdir("/sys/fs/cgroup/pids"):  # as root the run had a cgroup; it is gone
        assert made and not any(os.path.exists(c) for c in made), made


def test_without_bwrap_root_falls_back_to_a_fresh_uid_and_others_are_refused(monkeypatch, fresh_modes):
    real_which = shutil.which
    monkeypatch.setattr(S.shutil, "which", lambda name: None if name == "bwrap" else real_which(name))
    if os.geteuid() == 0:  # the weaker boundary is never picked silently: the warning names why
        with pytest.warns(RuntimeWarning, match="falls back to 'uid' because bwrap: bwrap is not installed"):
            assert resolve_mode("auto") == "uid"
    resolve_mode.cache_clear()
    monkeypatch.setattr(S.os, "geteuid", lambda: 1000)
    with pytest.raises(PosttrainError, match="unsafe_inprocess_guard") as err:
        resolve_mode("auto")
    assert "bwrap is not installed" in str(err.value) and "not running as root" in str(err.value)
    with pytest.warns(UserWarning, match="not a security boundary"):
        assert resolve_mode("unsafe_inprocess_guard") == "unsafe_inprocess_guard"
    with pytest.raises(PosttrainError, match="unknown mode"):
        Sandbox(mode="docker")


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid fallback exists only for root (it switches to another uid)")
def test_uid_fallback_holds_without_the_python_guard(tmp_path):
    """The OS part of the uid fallback alone: another uid cannot read root's files, signal root's
    processes or write root's folders, and a setsid child does not outlive the run."""
    if not os.path.exists(SYSTEM_PYTHON):  # a fresh uid cannot reach root's pyenv; make setup installs python3
        pytest.fail(f"{SYSTEM_PYTHON} is missing: make setup installs it (python3-seccomp)")
    secret = tmp_path / "secret"
    secret.write_text("CANARY-uid")
    secret.chmod(0o600)
    victim = subprocess.Popen(["sleep", "60"])
    marker = "posttrain-uid-leftover"
    code = f"""
import os, signal
def attempt(label, fn):
    try:
        print(label, 'RESULT', fn())
    except OSError as e:
        print(label, 'REFUSED', type(e).__name__)
attempt('read', lambda: open({str(secret)!r}).read())
attempt('kill', lambda: os.kill({victim.pid}, signal.SIGKILL))
attempt('write', lambda: open({str(tmp_path / 'planted')!r}, 'w').write('x'))
if os.fork() == 0:
    os.setsid()
    os.execv('/bin/sh', ['sh', '-c', 'sleep 1000; true', {marker!r}])
"""
    try:
        r = Sandbox(mode="uid", guard=False, python=SYSTEM_PYTHON).run({"main.py": code})
        assert r.backend == "uid" and r.status == "ok", r.stderr
        assert r.stdout.split("\n")[:3] == ["read REFUSED PermissionError", "kill REFUSED PermissionError",
                                            "write REFUSED PermissionError"], r.stdout
        assert victim.poll() is None and not (tmp_path / "planted").exists()
        time.sleep(0.2)
        leftovers = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, marker)]
        assert leftovers == [], "a setsid child outlived the uid sandbox"
    finally:
        victim.kill()
        victim.wait()


def _cmdline_has(pid: str, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except OSError:
        return False


@pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are made only as root (not root: RLIMIT_AS and the filter)")
def test_as_root_a_run_is_bounded_by_its_own_pids_and_memory_cgroups(monkeypatch):
    """Each process within RLIMIT_AS, together beyond the run's memory cgroup (memory_mb + disk_mb + 64 MB): the
    kernel kills within the run, and the cgroups carry the limits and are gone after it."""
    seen = {}
    real_remove = S.remove_cgroup

    def remove(path):
        for name in ("pids.max", "memory.limit_in_bytes", "memory.max"):
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name)) as f:
                    seen[name] = f.read().strip()
        real_remove(path)
        seen.setdefault("removed", []).append(not os.path.exists(path))

    monkeypatch.setattr(S, "remove_cgroup", remove)
    code = ("import os\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = b'x' * (100 << 20)\n        import time\n        time.sleep(2)\n        os._exit(0)\n"
            "    kids.append(pid)\nprint([os.waitpid(k, 0)[1] for k in kids])\n")
    r = Sandbox(guard=False, memory_mb=128, disk_mb=32, max_processes=8, timeout_s=20.0).run({"main.py": code})
    assert r.status == "ok", r
    statuses = ast.literal_eval(r.stdout)
    assert any(s & 0x7F == 9 for s in statuses) and 0 in statuses, statuses  # some killed (OOM), some fit
    assert seen["pids.max"] == "11" and all(seen["removed"]), seen
    assert int(seen.get("memory.limit_in_bytes", seen.get("memory.max"))) == (128 + 32 + 64) << 20, seen


def test_the_seccomp_filter_loads_once_when_threads_ask_together():
    """CodeTests runs programs from 8 threads: their first calls, released together in a fresh process while the
    first load is still under way (slowed down here), load libseccomp's extension module once (a second load was
    seen to raise "Module 'seccomp' has already been imported") and all get the same filter."""
    code = ("import importlib.util, threading, time\n"
            "load, loads = importlib.util.module_from_spec, []\n"
            "def slow(spec):\n"
            "    loads.append(spec.name)\n"
            "    time.sleep(0.3)\n"
            "    return load(spec)\n"
            "importlib.util.module_from_spec = slow\n"
            "from posttrain.sandbox import _seccomp\n"
            "gate, out, errors = threading.Barrier(8), [], []\n"
            "def ask():\n"
            "    gate.wait()\n"
            "    try:\n"
            "        out.append(_seccomp.seccomp_program())\n"
            "    except Exception as e:\n"
            "        errors.append(repr(e))\n"
            "threads = [threading.Thread(target=ask) for _ in range(8)]\n"
            "[t.start() for t in threads]; [t.join() for t in threads]\n"
            "assert not errors, errors\n"
            "assert loads.count('seccomp') <= 1, loads\n"
            "assert len(out) == 8 and len(set(out)) == 1 and len(out[0]) > 100, [len(x) for x in out]\n"
            "print('ok')\n")
    r = subprocess.run([os.sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
