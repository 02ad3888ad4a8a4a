"""The one place model-written code runs: a child process behind an OS boundary, with limits.

What it is: `Sandbox(...).run(files, entry)` runs a Python program (`files`: name -> text, placed in a
read-only folder `/sandbox`; `entry`: the one to execute) and returns a `SandboxResult`. The python
tool of agentic episodes (`agentic.tools.PythonTool`) and every reward that runs model-written code
(`rewards.code.CodeTests`) go through it; nothing else in posttrain executes model output.

The boundary, by `mode` ("auto" picks the first that works on this machine, once per process, and warns with the
reason when it is not bwrap):
- "bwrap": Debian's bubblewrap (`bwrap`, installed by `make setup`) behind a set-up shell in a private mount
  namespace (`_bwrap_argv`). As root the shell joins the run's fresh pids and memory cgroups, mounts the one
  writable folder and drops to a fresh unprivileged uid of the run's own (`setpriv`, no groups) before bwrap, so
  nothing of the run is host root (its /proc/self/uid_map reads `65534 <that uid> 1`); not root, the shell runs in
  a user namespace of its own, and the program runs as the trainer's uid (no other uid can be had without
  privilege). bwrap then adds new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`): the
  program sees no host process (it is PID 2 of its own namespace), has no network but its own empty loopback, and
  sees only read-only binds of /usr and the interpreter's folders (staged by the shell where they sit behind a
  folder the run's uid cannot pass, pyenv under /root; bound after /tmp, so a venv under /tmp stays visible), a
  read-only `/sandbox`, a read-only `/` and `/dev` (null, zero, full, random, urandom; no devpts, no /dev/shm),
  `/proc` with `/proc/sys` read-only and `/proc/keys` hidden, and one tmpfs at /tmp bounded in bytes (`disk_mb`)
  and inodes (`max_inodes`): the only writable place. A seccomp filter built with libseccomp (`_seccomp.py`)
  answers EPERM to the kernel's keyrings, ptrace and other processes' memory, io_uring, userfaultfd, perf, bpf,
  mounts and namespaces, modules, kexec, memfd and SysV / POSIX IPC (memory outside RLIMIT_AS), inotify /
  fanotify (per-user quotas), and the rest of `_seccomp._DENIED_CALLS`. `--die-with-parent`, and the wall-clock limit
  SIGKILLs bwrap, whose namespace takes every process of the run with it (a `setsid` child included). As root the
  cgroups bound the run's tasks (max_processes + 3) and memory (memory_mb + disk_mb + 64 MB).
- "uid" (no bwrap, running as root): the program runs as a fresh unprivileged uid of its own
  (`setpriv`), in a folder only that uid may write; after the run every process of that uid is killed
  (a `setsid` child included). No namespaces, no seccomp filter, no network isolation beyond the Python guard:
  prefer bwrap.
- "unsafe_inprocess_guard": only when a config names it (a warning is printed): the child runs as the
  trainer's own user with the Python-level guard alone (what posttrain had before bubblewrap).
  "auto" never picks it: without bwrap or root, running model-written code is refused.

In every mode the child sets rlimits on itself first (address space, CPU seconds, file size, open
files, processes/threads, no core dumps; `_guard.py`) and installs the audit-hook guard of
`_guard.py` as defence in depth. stdout and stderr go to files outside the sandbox and come back
truncated. `drive` adds a request / reply channel (the code_tests judge: posttrain/rewards/code.py). The threat
model and what each boundary stops, as tested: docs/security.md.

What it is not: a virtual machine (the kernel is shared: a kernel exploit escapes any namespace sandbox) and
not a place for trusted code (a config that names `package.module:function` runs that code in the trainer,
by design).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import warnings
from typing import Any, Callable, Mapping, Optional

from posttrain.errors import PosttrainError
from posttrain.sandbox._seccomp import seccomp_fd as _seccomp_fd
from posttrain.sandbox._seccomp import seccomp_program as _seccomp_program  # noqa: F401  (tests check it)
from posttrain.sandbox.channel import Channel
from posttrain.sandbox.processes import (
    fresh_uid,
    kill_group,
    kill_uid,
    make_cgroups,
    remove_cgroup,
    wait_unreaped,
)

MODES = ("auto", "bwrap", "uid", "unsafe_inprocess_guard")
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")
MEMORY_RC = 3  # the child's exit status after a MemoryError (see _guard.py)
BOX = "/sandbox"  # inside bwrap: the read-only program folder
WORK = "/tmp"  # inside bwrap: the one writable folder (a private tmpfs)
RUN = "run"  # inside bwrap: the program's working folder, WORK/RUN (fresh and empty)
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
    max_inodes: int = 4096  # files + folders the writable tmpfs may hold (bwrap mode: its nr_inodes)
    max_output_bytes: int = 1 << 16  # stdout / stderr bytes read back
    mode: str = "auto"  # auto, bwrap, uid or unsafe_inprocess_guard (see the module docstring)
    python: str = sys.executable  # the interpreter; its folders are bound read-only
    guard: bool = True  # the Python-level audit-hook guard as well (False: the OS boundary alone, for its tests)

    def __post_init__(self):
        if self.mode not in MODES:
            raise PosttrainError(f"sandbox: unknown mode {self.mode!r}; use one of {', '.join(MODES)}")
        if not (self.timeout_s > 0 and self.memory_mb > 0 and self.max_file_mb > 0 and self.max_open_files > 0
                and self.max_processes > 0 and self.disk_mb > 0 and self.max_inodes > 0
                and self.max_output_bytes > 0):
            raise PosttrainError("sandbox: timeout_s, memory_mb, max_file_mb, max_open_files, max_processes, "
                                 "disk_mb, max_inodes and max_output_bytes must be > 0")

    @property
    def backend(self) -> str:
        """The boundary this sandbox uses on this machine (raises PosttrainError when none is available)."""
        return resolve_mode(self.mode, self.python)

    def run(self, files: Mapping[str, str], entry: str = "main.py", stdin: bytes = b"") -> SandboxResult:
        """Run `entry` (one of `files`) in a fresh sandbox; `stdin` is fed to it. Never raises for what
        the program does."""
        return self._run(files, entry, stdin, self.backend)

    def drive(self, files: Mapping[str, str], entry: str, driver: Callable[[Callable[[Any], Any]], Any]
              ) -> tuple[SandboxResult, Any]:
        """Run `entry` with a request / reply channel while `driver(ask)` runs here: `ask(obj)` writes `obj` as one
        JSON line to the program's stdin and returns the JSON value of the next line the program writes to the
        descriptor named by its environment's POSTTRAIN_REPLY_FD (EOFError, OSError, TimeoutError or ValueError when
        it does not answer within the run's time limit, answers more than max_output_bytes, or not JSON). After the
        driver returns, the program's stdin is closed and the run ends as `run`'s does. Returns (the run's result,
        the driver's value); an exception of the driver propagates once the run is cleaned up."""
        return self._run(files, entry, b"", self.backend, driver)

    def _run(self, files: Mapping[str, str], entry: str, stdin: bytes, backend: str,
             driver: Optional[Callable] = None):
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
                os.chmod(outer, 0o711)  # the run's uid passes through to its program folder, lists nothing
            else:
                work, box_in = os.path.join(outer, "work"), box
                os.mkdir(work, 0o700)
                os.chmod(outer, 0o755)
                if backend == "uid":
                    uid = fresh_uid()
                    os.chown(work, uid, uid)
            limits = [str(self.memory_mb << 20), str(cpu), str(self.max_file_mb << 20), str(self.max_open_files),
                      str(self.max_processes if backend != "unsafe_inprocess_guard" else -1), str(int(self.guard))]
            child = [self.python, "-I", "-B", "-u", f"{box_in}/_guard.py", work, f"{box_in}/{entry}", *limits]
            env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LC_ALL": "C.UTF-8",
                   "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
            cgroups, fds, channel = [], (), None
            if driver is not None:  # requests on stdin, replies on a pipe of their own (stdout stays the program's)
                channel = (*os.pipe(), *os.pipe())  # request read / write, reply read / write
                env["POSTTRAIN_REPLY_FD"] = str(channel[3])
            if backend == "bwrap":
                if os.geteuid() == 0:  # + bwrap, its init and the set-up shell
                    cgroups = make_cgroups(self.max_processes + 3, (self.memory_mb + self.disk_mb + 64) << 20)
                fds = (_seccomp_fd(),)
                argv = _bwrap_argv(self, outer, box, env, child, fds[0], cgroups)
            elif backend == "uid":
                argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *child]
            else:
                argv = child
            if channel is not None:
                fds = (*fds, channel[3])
            owned = {*fds, *(channel or ())}  # each closed once: a second close could hit another thread's file
            try:
                return self._launch(argv, env, outer, work, stdin, uid, backend, fds, driver, channel, owned)
            finally:
                for fd in owned:
                    os.close(fd)
                for cgroup in cgroups:
                    remove_cgroup(cgroup)

    def _launch(self, argv, env, outer, work, stdin, uid, backend, fds=(), driver=None, channel=None, owned=None):
        with open(os.path.join(outer, "stdout"), "w+b") as out, open(os.path.join(outer, "stderr"), "w+b") as err, \
                tempfile.TemporaryFile() as inp:
            if channel is None:
                inp.write(stdin)
                inp.seek(0)
            start = time.monotonic()
            proc = subprocess.Popen(argv, cwd=work if backend != "bwrap" else outer, env=env,
                                    stdin=inp if channel is None else channel[0], stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True, pass_fds=fds)
            value, failure = None, None
            if channel is not None:
                for fd in (channel[0], channel[3]):  # the child's ends: an exit of the program is then EOF here
                    owned.discard(fd)
                    os.close(fd)
                try:
                    value = driver(Channel(channel[1], channel[2], start + self.timeout_s, self.max_output_bytes))
                except BaseException as e:  # noqa: B036  (re-raised below, once the run is cleaned up)
                    failure = e
                owned.discard(channel[1])
                os.close(channel[1])  # EOF on the program's stdin: it is done
            timed_out = not wait_unreaped(proc.pid, start + self.timeout_s)
            kill_group(proc.pid)  # before reaping: the group id cannot belong to anyone else yet
            rc = None if timed_out else proc.wait()
            proc.wait()
            if backend == "bwrap" and rc is not None and rc > 128:  # bwrap reports its child's signal as 128 + n
                rc = 128 - rc
            if uid is not None:
                kill_uid(uid)
            seconds = time.monotonic() - start
            stdout, stderr = (_read_head(fh, self.max_output_bytes) for fh in (out, err))
        result = SandboxResult(_status(rc, timed_out, stderr), stdout, stderr, rc, seconds, backend)
        if failure is not None:
            raise failure
        return result if channel is None else (result, value)

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


@functools.lru_cache(maxsize=None)
def _reachable(folder: str) -> bool:
    """Whether any uid may pass through every folder down to `folder` and read it (else it is staged)."""
    path = "/"
    for part in [p for p in folder.split("/") if p]:
        path = os.path.join(path, part)
        mode = os.stat(path).st_mode
        if not mode & 0o001 or (path == folder and not mode & 0o004):
            return False
    return True


def _bwrap_argv(box: "Sandbox", outer: str, prog: str, env: Mapping[str, str], child: list[str], seccomp_fd: int,
                cgroups: list[str]) -> list[str]:
    """The command of a bwrap run: a set-up shell in a private mount namespace (as root: joins the run's cgroups,
    mounts, drops to a fresh uid; not root: a user namespace of its own for the mounts), then bwrap.

    The shell mounts the one writable folder, a tmpfs bounded in bytes and inodes (bwrap's own --tmpfs takes no
    inode limit), and binds the interpreter's folders beside the run (under `outer`, which the run's uid may
    traverse): a uid that cannot traverse where they live (pyenv under /root, mode 700) still reaches them."""
    root = os.geteuid() == 0
    q = shlex.quote
    uid = fresh_uid() if root else 0  # not root: uid 0 of the set-up namespace, which is this user outside
    work = os.path.join(outer, "work")
    os.mkdir(work, 0o700)
    lines = ["set -e"] + [f"echo $$ > {q(os.path.join(c, 'cgroup.procs'))}" for c in cgroups]
    lines.append(f"mount -t tmpfs -o size={box.disk_mb << 20},nr_inodes={box.max_inodes},mode=0700,uid={uid},"
                 f"gid={uid},nosuid,nodev posttrain-sandbox {q(work)}")
    # the program starts in a folder of its own inside /tmp: an interpreter bound under /tmp (a checkout or venv
    # there) puts its mount point in /tmp, never in the program's fresh, empty working folder
    lines.append(f"mkdir -m 0700 {q(os.path.join(work, RUN))} && chown {uid}:{uid} {q(os.path.join(work, RUN))}")
    binds = []
    for i, d in enumerate(d for d in _python_dirs(box.python) if not d.startswith("/usr/")):
        if not (root and not _reachable(d)):
            binds += ["--ro-bind", d, d]
            continue
        stage = os.path.join(outer, f"python{i}")
        os.mkdir(stage, 0o755)
        lines.append(f"mount --bind {q(d)} {q(stage)}")
        binds += ["--ro-bind", stage, d]
    drop = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if root else []
    # No capability and an unprivileged uid inside the user namespace: a root-in-namespace with CAP_SYS_ADMIN
    # could remount the read-only binds writable. No devpts (bwrap's --dev): it would make bwrap nest a second user
    # namespace, and the program needs no terminal.
    args = ["--unshare-all", "--unshare-user", "--cap-drop", "ALL", "--uid", "65534", "--gid", "65534",
            "--die-with-parent", "--new-session", "--clearenv", "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "lib", "lib32", "lib64", "sbin"):  # merged /usr: links; else read-only binds
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--bind", work, WORK]
    args += binds  # after the private /tmp: an interpreter or venv under /tmp stays visible on top of it
    args += ["--ro-bind", prog, BOX, "--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
             "--ro-bind", "/dev/null", "/proc/keys", "--ro-bind", "/dev/null", "/proc/key-users"]
    for dev in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{dev}", f"/dev/{dev}"]
    args += ["--symlink", "/proc/self/fd", "/dev/fd"]
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        args += ["--symlink", f"/proc/self/fd/{i}", f"/dev/{name}"]
    args += ["--remount-ro", "/", "--chdir", f"{WORK}/{RUN}", "--seccomp", str(seccomp_fd)]
    for k, v in env.items():
        args += ["--setenv", k, v]
    lines.append("exec " + " ".join(q(a) for a in [*drop, _bwrap(), *args, "--", *child]))
    setup = ["unshare", "--mount", "--propagation", "private"] if root else \
        ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"]
    return [*setup, "--", "/bin/sh", "-c", "\n".join(lines)]


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
    except (OSError, PosttrainError) as e:  # PosttrainError: libseccomp's bindings are missing
        return f"{type(e).__name__}: {e}"
    if r.status != "ok" or r.stdout.strip() != "ok":
        return (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1][:200]
    return None


def _read_head(fh, max_bytes: int) -> str:
    """The start of a file the child wrote (at most `max_bytes`), with a note of the full size when there was more."""
    size = fh.seek(0, os.SEEK_END)
    fh.seek(0)
    raw = fh.read(max_bytes)
    data = raw.decode("utf-8", errors="replace")
    return data if len(raw) == size else data + f"\n... [truncated: {size} bytes in all]"
