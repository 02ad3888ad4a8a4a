"""The sandbox's seccomp filter (posttrain.sandbox, bwrap mode): built once a process with libseccomp's own Python
bindings, handed to bwrap's --seccomp as BPF on a pipe.

What it is: allow by default, EPERM for the calls an untrusted Python program has no use for and that reach past
the namespaces (`_DENIED_CALLS`, namespace flags of clone, terminal injection), ENOSYS for clone3. What it is not:
an allow-list (the interpreter and numpy need a wide, version-dependent set of calls); the namespaces, the
read-only binds, the unprivileged uid and the rlimits are the rest of the boundary.
References: seccomp(2), libseccomp's Python bindings (Debian's python3-seccomp), bwrap(1) --seccomp.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import tempfile
import threading

from posttrain.errors import PosttrainError

# What the program may not call (EPERM), on top of bwrap's namespaces and --disable-userns: the kernel's keyrings
# (shared with the host), tracing and other processes' memory, io_uring, userfaultfd, perf, bpf, mounts and
# namespaces, modules, kexec, clocks, swap, reboot, syslog, file handles, memory outside RLIMIT_AS (memfd, SysV
# shm / queues / semaphores, POSIX queues), inotify / fanotify (per-user quotas), NUMA policy, terminal injection.
_DENIED_CALLS = (
    "add_key", "keyctl", "request_key", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "process_madvise", "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "bpf", "mount", "umount", "umount2", "pivot_root", "chroot", "unshare", "setns", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "iopl", "ioperm",
    "lookup_dcookie", "open_by_handle_at", "name_to_handle_at", "vhangup", "uselib", "ustat", "sysfs", "nfsservctl",
    "memfd_create", "memfd_secret", "shmget", "shmat", "msgget", "semget", "mq_open", "inotify_init",
    "inotify_init1", "fanotify_init", "mbind", "set_mempolicy", "migrate_pages", "move_pages",
    "personality", "vmsplice", "seccomp", "lsm_set_self_attr")
_CLONE_NS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080
_TIOCSTI, _TIOCLINUX = 0x5412, 0x541C
_SECCOMP_SO = "/usr/lib/python3/dist-packages"  # Debian's python3-seccomp (make setup installs it)


_LOAD = threading.RLock()  # lru_cache alone lets two threads' first calls load the extension module twice (CodeTests
#                           runs programs from 8 threads: "Module 'seccomp' has already been imported")


def seccomp_module():
    """libseccomp's own Python bindings: `import seccomp`, else Debian's python3-seccomp module file for this
    interpreter's ABI (a venv does not see Debian's dist-packages). PosttrainError when neither is there. Loaded
    once a process, whichever thread asks first."""
    with _LOAD:
        return _load_module()


@functools.lru_cache(maxsize=None)
def _load_module():
    try:
        import seccomp

        return seccomp
    except ImportError:
        pass
    import importlib.util

    path = os.path.join(_SECCOMP_SO, "seccomp" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if not os.path.exists(path):
        raise PosttrainError(f"sandbox: libseccomp's Python bindings are missing ({path}); make setup installs them "
                             "(apt-get install python3-seccomp)")
    spec = importlib.util.spec_from_file_location("seccomp", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seccomp_program() -> bytes:
    """The filter as BPF (built once a process with libseccomp): allow by default, EPERM for `_DENIED_CALLS`, for
    clone with a namespace flag and for TIOCSTI / TIOCLINUX; ENOSYS for clone3 (its flags are out of a filter's
    reach; libc falls back to clone). Only the native ABI: another's calls (i386 int 0x80) kill the process."""
    with _LOAD:
        return _build_program()


@functools.lru_cache(maxsize=None)
def _build_program() -> bytes:
    sc = seccomp_module()
    f = sc.SyscallFilter(sc.ALLOW)
    eperm = sc.ERRNO(1)
    for name in _DENIED_CALLS:
        try:
            f.add_rule(eperm, name)
        except (RuntimeError, ValueError, OSError):  # a call this libseccomp or architecture does not know
            pass
    f.add_rule(sc.ERRNO(38), "clone3")
    for bit in range(32):
        if _CLONE_NS & (1 << bit):
            f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
    for request in (_TIOCSTI, _TIOCLINUX):
        f.add_rule(eperm, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, request))
    with tempfile.TemporaryFile() as fh:
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()


def seccomp_fd() -> int:
    """A pipe's read end holding the filter, for bwrap's --seccomp (the caller closes it)."""
    program = seccomp_program()
    r, w = os.pipe()
    try:
        os.write(w, program)  # a few hundred bytes: far below a pipe's buffer
    finally:
        os.close(w)
    return r
