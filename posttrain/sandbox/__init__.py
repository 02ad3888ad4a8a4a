"""The one place model-written code runs: a child process behind an OS boundary, with limits.

What it is: `Sandbox(...).run(files, entry)` runs a Python program (`files`: name -> text, placed in a
read-only folder `/sandbox`; `entry`: the one to execute) and returns a `SandboxResult`. The python
tool of agentic episodes (`agentic.tools.PythonTool`) and every reward that runs model-written code
(`rewards.code.CodeTests`) go through it; nothing else in posttrain executes model output.

The boundary, by `mode` ("auto" picks the first that works on this machine, once per process):
- "bwrap": Debian's bubblewrap (`bwrap`, installed by `make setup`). New user, PID, network, IPC, UTS
  and cgroup namespaces (`--unshare-all`): the program sees no host process (it is PID 2 of its own
  namespace, with its own /proc), has no network but its own empty loopback, and sees only read-only
  binds of /usr and the interpreter's folders, read-only `/sandbox`, a minimal /dev, and one private
  size-limited tmpfs at /tmp (cwd, HOME, TMPDIR): the only writable place. `--die-with-parent`, and
  the wall-clock limit SIGKILLs bwrap, whose namespace takes every process of the run with it (a
  `setsid` child included). As root the run also joins a fresh pids cgroup (max_processes + bwrap's two tasks): the
  kernel does not apply RLIMIT_NPROC to a user namespace owned by root.
- "uid" (no user namespaces, running as root): the program runs as a fresh unprivileged uid of its own
  (`setpriv`), in a folder only that uid may write; after the run every process of that uid is killed
  (a `setsid` child included). No network isolation beyond the Python guard: prefer bwrap.
- "unsafe_inprocess_guard": only when a config names it (a warning is printed): the child runs as the
  trainer's own user with the Python-level guard alone (what posttrain had before bubblewrap).
  "auto" never picks it: without bwrap or root, running model-written code is refused.

In every mode the child sets rlimits on itself first (address space, CPU seconds, file size, open
files, processes/threads, no core dumps; `_guard.py`) and installs the audit-hook guard of
`_guard.py` as defence in depth. stdout and stderr go to files outside the sandbox and come back
truncated. The threat model and what each boundary stops: docs/security.md.

What it is not: a container runtime (no seccomp filter, no cgroup memory limit: memory is bounded per
process by RLIMIT_AS times RLIMIT_NPROC) and not a place for trusted code (a config that names
`package.module:function` runs that code in the trainer, by design).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from typing import Mapping, Optional

from posttrain.errors import PosttrainError

MODES = ("auto", "bwrap", "uid", "unsafe_inprocess_guard")
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")
MEMORY_RC = 3  # the child's exit status after a MemoryError (see _guard.py)
BOX = "/sandbox"  # inside bwrap: the read-only program folder
WORK = "/tmp"  # inside bwrap: the one writable folder (a private tmpfs)
_UID_BASE = 1 << 20  # "uid" mode: fresh uids from here on (no /etc/passwd entry needed)
_SIGNALS = {signal.SIGXCPU: "the CPU-time limit was exceeded", signal.SIGKILL: "the process was killed",
            signal.SIGSEGV: "the process crashed (segmentation fault)", signal.SIGABRT: "the process aborted"}


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What one run gave: `status` is "ok" (exit 0), "error" (non-zero exit, e.g. an exception), "timeout",
    "memory" or "killed" (a signal, e.g. the CPU limit); `backend` the boundary it ran behind."""

    status: str
    stdout: str
    stderr: str
    returncode: Optional[int]
    seconds: float
    backend: str


@dataclasses.dataclass(frozen=True)
class Sandbox:
    """Limits and boundary for model-written programs; `run` executes one."""

    timeout_s: float = 5.0  # wall-clock seconds before everything the run started is killed
    memory_mb: int = 512  # RLIMIT_AS per process (virtual memory: leave room for the interpreter)
    cpu_s: Optional[int] = None  # RLIMIT_CPU seconds; None: ceil(timeout_s) + 1
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file (stdout / stderr too) the program may write
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_processes: int = 16  # RLIMIT_NPROC: processes + threads of the run (bwrap / uid modes)
    disk_mb: int = 64  # size of the writable tmpfs (bwrap mode)
    max_output_bytes: int = 1 << 16  # stdout / stderr bytes read back
    mode: str = "auto"  # auto, bwrap, uid or unsafe_inprocess_guard (see the module docstring)
    python: str = sys.executable  # the interpreter; its folders are bound read-only
    guard: bool = True  # the Python-level audit-hook guard as well (False: the OS boundary alone, for its tests)

    def __post_init__(self):
        if self.mode not in MODES:
            raise PosttrainError(f"sandbox: unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if not (self.timeout_s > 0 and self.memory_mb > 0 and self.max_file_mb > 0 and self.max_open_files > 0
                and self.max_processes > 0 and self.disk_mb > 0 and self.max_output_bytes > 0):
            raise PosttrainError("sandbox: timeout_s, memory_mb, max_file_mb, max_open_files, max_processes, "
                                 "disk_mb and max_output_bytes must be > 0")

    @property
    def backend(self) -> str:
        """The boundary this sandbox uses on this machine (raises PosttrainError when none is available)."""
        return resolve_mode(self.mode, self.python)

    def run(self, files: Mapping[str, str], entry: str = "main.py", stdin: bytes = b"") -> SandboxResult:
        """Run `entry` (one of `files`) in a fresh sandbox; `stdin` is fed to it. Never raises for what
        the program does."""
        return self._run(files, entry, stdin, self.backend)

    def _run(self, files: Mapping[str, str], entry: str, stdin: bytes, backend: str) -> SandboxResult:
        cpu = self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1
        with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-", ignore_cleanup_errors=True) as outer:
            box = os.path.join(outer, "box")
            os.mkdir(box)
            for name, text in {**files, "_guard.py": _guard_source()}.items():
                if "/" in name or name.startswith("."):
                    raise PosttrainError(f"sandbox: file name {name!r} must be a plain name")
                with open(os.path.join(box, name), "w", encoding="utf-8") as f:
                    f.write(text)
            os.chmod(box, 0o755)
            for name in os.listdir(box):
                os.chmod(os.path.join(box, name), 0o444)
            uid = None
            if backend == "bwrap":
                work, box_in = WORK, BOX
            else:
                work, box_in = os.path.join(outer, "work"), box
                os.mkdir(work, 0o700)
                os.chmod(outer, 0o755)
                if backend == "uid":
                    uid = _UID_BASE + secrets.randbelow(1 << 20)
                    os.chown(work, uid, uid)
            limits = [str(self.memory_mb << 20), str(cpu), str(self.max_file_mb << 20), str(self.max_open_files),
                      str(self.max_processes if backend != "unsafe_inprocess_guard" else -1), str(int(self.guard))]
            child = [self.python, "-I", "-B", "-u", f"{box_in}/_guard.py", work, f"{box_in}/{entry}", *limits]
            env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8",
                   "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            cgroup = None
            if backend == "bwrap":
                argv = [_bwrap(), *_bwrap_args(self.python, box, self.disk_mb, env), "--", *child]
                cgroup = _pids_cgroup(self.max_processes + 2) if os.geteuid() == 0 else None  # + bwrap, its init
                if cgroup is not None:  # join it, then become bwrap: every task of the run is counted
                    argv = ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', cgroup, *argv]
            elif backend == "uid":
                argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *child]
            else:
                argv = child
            try:
                return self._launch(argv, env, outer, work, stdin, uid, backend)
            finally:
                if cgroup is not None:
                    _remove_cgroup(cgroup)

    def _launch(self, argv, env, outer, work, stdin, uid, backend) -> SandboxResult:
        with open(os.path.join(outer, "stdout"), "w+b") as out, open(os.path.join(outer, "stderr"), "w+b") as err, \
                tempfile.TemporaryFile() as inp:
            inp.write(stdin)
            inp.seek(0)
            start = time.monotonic()
            proc = subprocess.Popen(argv, cwd=work if backend != "bwrap" else outer, env=env, stdin=inp, stdout=out,
                                    stderr=err, start_new_session=True, close_fds=True)
            timed_out = not _wait_unreaped(proc.pid, start + self.timeout_s)
            _kill_group(proc.pid)  # before reaping: the group id cannot belong to anyone else yet
            rc = None if timed_out else proc.wait()
            proc.wait()
            if backend == "bwrap" and rc is not None and rc > 128:  # bwrap reports its child's signal as 128 + n
                rc = 128 - rc
            if uid is not None:
                _kill_uid(uid)
            seconds = time.monotonic() - start
            stdout, stderr = (_read_head(fh, self.max_output_bytes) for fh in (out, err))
        status = _status(rc, timed_out, stderr)
        return SandboxResult(status, stdout, stderr, rc, seconds, backend)

    def explain(self, r: SandboxResult) -> str:
        """A one-line "Error: ..." head for a result that is not ok ("" when ok)."""
        if r.status == "timeout":
            return f"Error: timed out after {self.timeout_s:g} s (wall-time limit); the process was killed."
        if r.status == "memory":
            return f"Error: the memory limit ({self.memory_mb} MB) was exceeded."
        if r.status == "killed":
            sig = -(r.returncode or 0)
            return f"Error: {_SIGNALS.get(sig, f'the process was killed by signal {sig}')}."
        if r.status == "error":
            return f"Error: the program exited with status {r.returncode}."
        return ""


def _status(rc, timed_out, stderr) -> str:
    if timed_out:
        return "timeout"
    if rc == 0:
        return "ok"
    if rc == MEMORY_RC and "the memory limit" in stderr:
        return "memory"
    if rc is not None and rc < 0:
        return "killed"
    return "error"


@functools.lru_cache(maxsize=None)
def _guard_source() -> str:
    with open(_GUARD, encoding="utf-8") as f:
        return f.read()


def _bwrap() -> str:
    return shutil.which("bwrap") or "bwrap"


def _python_dirs(python: str) -> list[str]:
    """The folders an interpreter needs: its real binary's prefix, its venv (if any) and its stdlib /
    site-packages, outermost first, without folders already inside another."""
    real = os.path.realpath(python)
    dirs = {os.path.dirname(os.path.dirname(real)), os.path.dirname(os.path.dirname(os.path.abspath(python)))}
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs |= {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
                 *(os.path.realpath(p) for p in sysconfig.get_paths().values())}
    dirs = sorted(d for d in dirs if os.path.isdir(d) and d != "/")
    return [d for d in dirs if not any(d != o and d.startswith(o + "/") for o in dirs)]


def _bwrap_args(python: str, box: str, disk_mb: int, env: Mapping[str, str]) -> list[str]:
    # No capability and an unprivileged uid inside the user namespace: a root-in-namespace with
    # CAP_SYS_ADMIN could remount the read-only binds writable.
    args = ["--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):  # merged /usr: links; else read-only binds
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--size", str(disk_mb << 20), "--tmpfs", WORK]
    # After the private /tmp: an interpreter or venv under /tmp (a fresh clone in /tmp) stays visible on top of it.
    for d in _python_dirs(python):
        if not d.startswith("/usr/"):
            args += ["--ro-bind", d, d]
    args += ["--ro-bind", box, BOX, "--proc", "/proc", "--dev", "/dev", "--chdir", WORK, "--disable-userns"]
    for k, v in env.items():
        args += ["--setenv", k, v]
    return args


@functools.lru_cache(maxsize=None)
def resolve_mode(mode: str, python: str = sys.executable) -> str:
    """The boundary `mode` means here: "auto" tries bwrap, then (as root) a fresh uid; PosttrainError
    when the named or any safe boundary cannot start."""
    if mode == "unsafe_inprocess_guard":
        warnings.warn("sandbox: unsafe_inprocess_guard runs model-written code as this user with only a Python-level "
                      "guard, which is not a security boundary; install bubblewrap (apt-get install bubblewrap)",
                      stacklevel=2)
        return mode
    tried = []
    for backend in (("bwrap", "uid") if mode == "auto" else (mode,)):
        why = _probe(backend, python)
        if why is None:
            if tried:  # never silently weaker: say which boundary failed and why
                warnings.warn(f"sandbox: auto falls back to {backend!r} because " + "; ".join(tried),
                              RuntimeWarning, stacklevel=2)
            return backend
        tried.append(f"{backend}: {why}")
    raise PosttrainError("sandbox: cannot run model-written code safely here (" + "; ".join(tried) + "). Install "
                         "bubblewrap (apt-get install bubblewrap) with user namespaces enabled, or set the config's "
                         "sandbox: unsafe_inprocess_guard to accept a Python-level guard only")


def _probe(backend: str, python: str) -> Optional[str]:
    """None if a trivial program runs behind `backend`, else why not."""
    if backend == "bwrap" and shutil.which("bwrap") is None:
        return "bwrap is not installed"
    if backend == "uid":
        if os.geteuid() != 0:
            return "not running as root"
        if shutil.which("setpriv") is None:
            return "setpriv is not installed"
    try:
        r = Sandbox(timeout_s=30.0, python=python)._run({"main.py": "print('ok')"}, "main.py", b"", backend)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    if r.status != "ok" or r.stdout.strip() != "ok":
        return (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1][:200]
    return None


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


def _kill_group(pgid: int) -> None:
    """SIGKILL the child's process group (it leads its own session). Behind bwrap this kills bwrap, and
    with it the PID namespace and every process in it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _pids_cgroup(limit: int) -> Optional[str]:
    """As root: a fresh pids cgroup allowing `limit` tasks, or None where none can be made. Behind bwrap as root the
    run's uid maps to root outside, and the kernel does not apply RLIMIT_NPROC to root's user: without this a fork
    bomb filled the host's PID table (32768 tasks: every other process then failed to fork or start a thread)."""
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):  # cgroup v1's pids hierarchy, or v2's
        path = os.path.join(root, f"posttrain-sandbox-{secrets.token_hex(6)}")
        try:
            os.mkdir(path)
        except OSError:
            continue
        try:
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(limit))
            return path
        except OSError:
            os.rmdir(path)
    return None


def _remove_cgroup(path: str) -> None:
    """SIGKILL whatever is left in the run's cgroup, then remove it."""
    for _ in range(200):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        _sigkill(pids)
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.01)


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is `uid` ("uid" mode: the run's own uid), until none is left."""
    for _ in range(50):
        pids = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == uid:
                        pids.append(int(name))
                except OSError:
                    pass
        if not pids:
            return
        _sigkill(pids)
        time.sleep(0.01)


def _sigkill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _read_head(fh, max_bytes: int) -> str:
    """The start of a file the child wrote (at most `max_bytes`), with a note of the full size when there was more."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    raw = fh.read(max_bytes)
    data = raw.decode("utf-8", errors="replace")
    return data if len(raw) == size else data + f"\n... [truncated: {size} bytes in all]"
