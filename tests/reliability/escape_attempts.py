"""The escape attempts of tests/reliability/test_sandbox_escapes.py (issues #34, #54): each a program a model
optimised on code rewards might write, run there through `Sandbox.run` with the guard on and off. `PRELUDE` defines
`attempt(label, fn)` (prints RESULT or REFUSED) and `call(name, *args)` (a raw syscall); `{placeholders}` are filled
per run by the test (`_fields`). `MUST_FAIL`: labels whose RESULT line is an escape; `MUST_EPERM`: those the
seccomp filter must refuse with EPERM when the guard is off.
"""

from __future__ import annotations

import platform

# Syscall numbers for the attempts that call the kernel directly (ctypes), by machine.
SYSCALLS = {
    "x86_64": dict(keyctl=250, add_key=248, io_uring_setup=425, userfaultfd=323, perf_event_open=298, bpf=321,
                   unshare=272, mount=165, ptrace=101, process_vm_readv=310, shmget=29, memfd_create=319,
                   inotify_init1=294, kexec_load=246, setns=308, pidfd_getfd=438),
    "aarch64": dict(keyctl=219, add_key=217, io_uring_setup=425, userfaultfd=282, perf_event_open=241, bpf=280,
                    unshare=97, mount=40, ptrace=117, process_vm_readv=270, shmget=194, memfd_create=279,
                    inotify_init1=26, kexec_load=104, setns=268, pidfd_getfd=438),
}[platform.machine()]
SYSCTLS = ("kernel/core_pattern", "vm/nr_hugepages", "vm/drop_caches", "fs/file-max")


PRELUDE = """
import os, sys, signal, socket, time
def attempt(label, fn):
    try:
        print(label, 'RESULT', repr(fn())[:300], flush=True)
    except BaseException as e:
        print(label, 'REFUSED', type(e).__name__, str(e)[:200], flush=True)
def call(name, *args):
    def run():
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        r = libc.syscall({SYS}[name], *args)
        if r < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        return r
    attempt('sys_' + name, run)
"""

# name -> program. {placeholders} are filled per run: SECRET (a file of this host holding CANARY),
# PLANT (a path that must not come to exist), VICTIM (a pid of this user that must survive), MARKER
# (in the command line of anything the attempt leaves running), ports and socket paths of listeners.
ATTEMPTS = {
    "guard_closure_rewrite": """
def bypass():
    try:
        open('/etc/hostname')  # refused by the guard: its traceback holds the guard's frame
    except OSError as e:
        tb = e.__traceback__
        while tb.tb_next:
            tb = tb.tb_next
        inside = tb.tb_frame.f_locals.get('inside')
        for cell in (inside.__closure__ if inside else ()):
            try:
                if cell.cell_contents is any:
                    cell.cell_contents = lambda *a: True
            except ValueError:
                pass
attempt('bypass', bypass)
attempt('guard_gone', lambda: len(open('/proc/self/status').read()))  # the guard refuses this unless bypassed
attempt('read', lambda: open({SECRET!r}).read())
attempt('write', lambda: open({PLANT!r}, 'w').write('x'))
""",
    "posixsubprocess_renamed": """
def run():
    import importlib.machinery, importlib.util
    so = (f'{{sys.base_prefix}}/lib/python{{sys.version_info[0]}}.{{sys.version_info[1]}}/lib-dynload/'
          f'_posixsubprocess{{importlib.machinery.EXTENSION_SUFFIXES[0]}}')
    loader = importlib.machinery.ExtensionFileLoader('evil._posixsubprocess', so)
    mod = importlib.util.module_from_spec(importlib.util.spec_from_file_location('evil._posixsubprocess', so,
                                                                                 loader=loader))
    loader.exec_module(mod)
    cmd = "echo pwned > {PLANT}; setsid sh -c 'sleep 1000; true' {MARKER} & sleep 0.3"
    r, w = os.pipe()
    pid = mod.fork_exec([b'/bin/sh', b'-c', cmd.encode()], [b'/bin/sh'], True, (w,), None, None, -1, -1, -1, -1,
                        -1, -1, r, w, True, True, -1, None, None, None, -1, None, False)
    os.close(w)
    time.sleep(0.5)
    return pid
attempt('fork_exec', run)
""",
    "dir_fd_pth_in_site_packages": """
def run():
    fd = os.open({SITE!r}, os.O_RDONLY)
    out = os.open({PTH!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd)
    return os.write(out, b'import os; os.system("touch {PLANT}")\\n')
attempt('pth', run)
""",
    "pidfd_kill_victim": """
attempt('pidfd', lambda: signal.pidfd_send_signal(os.pidfd_open({VICTIM}), signal.SIGKILL))
""",
    "read_etc_shadow": """
attempt('shadow', lambda: open('/etc/shadow').read())
""",
    "read_parent_environ": """
for pid in ({PARENT}, os.getppid(), 1):
    attempt(f'environ{{pid}}', lambda: open(f'/proc/{{pid}}/environ', 'rb').read())
""",
    "read_host_file": """
attempt('read', lambda: open({SECRET!r}).read())
attempt('listdir', lambda: os.listdir({TMP!r}))
""",
    "write_outside_absolute": """
attempt('write', lambda: open({PLANT!r}, 'w').write('x'))
""",
    "write_via_symlink": """
attempt('symlink', lambda: os.symlink({PLANT!r}, 'link'))
attempt('write', lambda: open('link', 'w').write('x'))
""",
    "write_via_hardlink": """
attempt('link', lambda: os.link({SECRET!r}, 'hard'))
attempt('write', lambda: open('hard', 'w').write('overwritten'))
""",
    "write_via_dir_fd_of_root": """
def run():
    fd = os.open('/', os.O_RDONLY)
    return os.write(os.open({PLANT_REL!r}, os.O_WRONLY | os.O_CREAT, dir_fd=fd), b'x')
attempt('dirfd', run)
""",
    "proc_self_root": """
attempt('read', lambda: open('/proc/self/root' + {SECRET!r}).read())
attempt('write', lambda: open('/proc/self/root' + {PLANT!r}, 'w').write('x'))
attempt('parent_root', lambda: open('/proc/{PARENT}/root' + {SECRET!r}).read())
""",
    "network_tcp": """
def run():
    s = socket.create_connection(('127.0.0.1', {TCP_PORT}), timeout=1)
    return s.sendall(b'leak')
attempt('tcp', run)
""",
    "network_udp": """
def run():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return s.sendto(b'leak', ('127.0.0.1', {UDP_PORT}))
attempt('udp', run)
""",
    "network_unix_path": """
def run():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({UNIX_PATH!r})
    return s.sendall(b'leak')
attempt('unix', run)
""",
    "network_unix_abstract": """
def run():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect({UNIX_ABSTRACT!r})
    return s.sendall(b'leak')
attempt('abstract', run)
""",
    "network_dns": """
attempt('dns', lambda: socket.getaddrinfo('pypi.org', 443))
attempt('localhost', lambda: socket.getaddrinfo('localhost', 80))
""",
    "fork_then_write": """
def run():
    pid = os.fork()
    if pid == 0:
        try:
            open({PLANT!r}, 'w').write('x')
        finally:
            os.execv('/bin/sh', ['sh', '-c', 'sleep 1000; true', {MARKER!r}])
    return pid
attempt('fork', run)
time.sleep(0.3)
""",
    "posix_spawn": """
attempt('spawn', lambda: os.posix_spawn('/bin/sh', ['sh', '-c', 'echo x > {PLANT}; sleep 1000; true', {MARKER!r}],
                                        {{}}))
time.sleep(0.3)
""",
    "ctypes_fork_execve": """
def run():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    pid = libc.fork()
    if pid == 0:
        argv = (ctypes.c_char_p * 5)(b'sh', b'-c', b'echo x > {PLANT}; sleep 1000; true', {MARKER!r}.encode(), None)
        libc.execve(b'/bin/sh', argv, None)
        libc._exit(1)
    return pid
attempt('ctypes', run)
time.sleep(0.3)
""",
    "ptrace_victim": """
def run():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.ptrace(16, {VICTIM}, 0, 0), ctypes.get_errno()  # PTRACE_ATTACH
attempt('ptrace', run)
""",
    "signal_victim_and_everyone": """
attempt('kill', lambda: os.kill({VICTIM}, signal.SIGKILL))
attempt('kill_all', lambda: os.kill(-1, signal.SIGKILL))
""",
    "fork_bomb": """
def run():
    n = 0
    while True:
        os.fork()
        n += 1
attempt('bomb', run)
while True:
    pass
""",
    "thread_bomb": """
def run():
    import threading
    ev, n = threading.Event(), 0
    while True:
        threading.Thread(target=ev.wait, daemon=True).start()
        n += 1
        if n > 100000:
            return n
attempt('threads', run)
""",
    "memory_fill": """
xs = []
while True:
    xs.append(bytearray(2**26))
""",
    "disk_fill": """
def run():
    total, i = 0, 0
    while True:
        with open(f'fill{{i}}', 'wb') as f:
            for _ in range(8):
                f.write(b'x' * 2**20)
                total += 2**20
        i += 1
attempt('disk', run)
""",
    "infinite_output": """
while True:
    sys.stdout.write('y' * 4096)
""",
    "leftover_after_time_limit": """
def daemon():
    try:
        pid = os.fork()
    except PermissionError:
        return 'refused'
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv('/bin/sh', ['sh', '-c', 'sleep 1000; true', {MARKER!r}])
        os._exit(0)
    return pid
attempt('daemon', daemon)
time.sleep(60)
""",
    "remount_usr_writable": """
def run():
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.mount(None, b'/usr', None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND, without MS_RDONLY
    open('/usr/' + {PLANT_NAME!r}, 'w').write('x')
    return rc
attempt('remount', run)
""",
    "write_interpreter_folder": """
attempt('venv', lambda: open(os.path.join(os.path.dirname(sys.executable), {PLANT_NAME!r}), 'w').write('x'))
attempt('stdlib', lambda: open(os.path.join(os.path.dirname(os.__file__), {PLANT_NAME!r}), 'w').write('x'))
""",
    "become_root": """
attempt('setuid', lambda: os.setuid(0))
attempt('unshare', lambda: os.unshare(os.CLONE_NEWUSER))
attempt('chroot', lambda: os.chroot('/tmp'))
""",
    # Issue #54: as root, bwrap mapped the sandbox's uid to host root, so host checks said yes.
    "host_uid": """
attempt('uid_map', lambda: open('/proc/self/uid_map').read())
attempt('status', lambda: [ln for ln in open('/proc/self/status') if ln.startswith(('Uid', 'CapEff'))])
""",
    "sysctl_writes": """
attempt('sysctl_core_pattern', lambda: open('/proc/sys/kernel/core_pattern', 'w').write('|/bin/sh -c "touch {PLANT}"'))
attempt('sysctl_nr_hugepages', lambda: open('/proc/sys/vm/nr_hugepages', 'w').write('64'))
attempt('sysctl_drop_caches', lambda: open('/proc/sys/vm/drop_caches', 'w').write('3'))
attempt('sysctl_file_max', lambda: open('/proc/sys/fs/file-max', 'w').write('1000'))
""",
    "keyrings": """
import ctypes
attempt('proc_keys', lambda: open('/proc/keys').read())
attempt('proc_key_users', lambda: open('/proc/key-users').read())
call('keyctl', 0, -3, 0)  # KEYCTL_GET_KEYRING_ID of the inherited session keyring
buf = ctypes.create_string_buffer(4096)
call('keyctl', 11, {HOST_KEY}, buf, 4096)  # KEYCTL_READ of the trainer's key
attempt('host_key', lambda: buf.raw[:64])
call('add_key', b'user', {MARKER!r}.encode(), b'x', 1, -2)  # a key meant to outlive the run
""",
    "inotify_quota": """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def fill():
    n = 0
    while n < 10000 and libc.syscall({SYS}['inotify_init1'], 0) >= 0:
        n += 1
    if n == 0:
        raise OSError(ctypes.get_errno(), 'inotify_init1')
    return n
attempt('inotify', fill)
""",
    "tmpfs_fill": """
def fill(folder):
    total = 0
    try:
        for i in range(64):
            with open(f'{{folder}}/fill{{i}}', 'wb') as f:
                for _ in range(8):
                    f.write(b'x' * 2**20)
                    total += 2**20
    except OSError:
        pass
    return total
for folder in ('', '/dev', '/dev/shm', '/proc', '/tmp'):
    print('filled', folder or '/', fill(folder), flush=True)
""",
    "inode_fill": """
n = 0
try:
    while n < 200000:
        open(f'/tmp/e{{n}}', 'w').close()
        n += 1
except OSError as e:
    pass
print('inodes', n, flush=True)
""",
    "memfd_sysv_fill": """
def memfd():
    fd = os.memfd_create('fill')
    for _ in range(256):
        os.write(fd, b'x' * 2**20)
    return 'held 256 MB'
attempt('memfd', memfd)
call('shmget', 0, 256 << 20, 0o1000 | 0o600)  # IPC_PRIVATE | IPC_CREAT
""",
    "ptrace_bwrap_init": """
call('ptrace', 16, 1, 0, 0)  # PTRACE_ATTACH to bwrap's init (pid 1), to clear its parent-death signal
def leave():
    if os.fork() == 0:
        os.setsid()
        os.execv('/bin/sh', ['sh', '-c', 'sleep 1000; true', {MARKER!r}])
    return 'forked'
attempt('leftover', leave)
time.sleep(60)
""",
    "seccomp_only_calls": """
import ctypes
call('io_uring_setup', 8, ctypes.create_string_buffer(120))
call('userfaultfd', 1)
call('perf_event_open', ctypes.create_string_buffer(128), 0, -1, -1, 0)
call('bpf', 0, None, 0)
call('unshare', 0x10000000)
call('mount', b'none', b'/tmp', b'tmpfs', 0, None)
call('process_vm_readv', 1, None, 0, None, 0, 0)
call('memfd_create', b'x', 0)
call('kexec_load', 0, 0, None, 0)
call('setns', 0, 0)
call('pidfd_getfd', 0, 0, 0)
""",
}

# Labels of attempts that must fail (a "RESULT" line is an escape), and those that must fail with EPERM when the
# guard is off (the seccomp filter's answer, not a side effect such as a bad argument).
_CALLS = {"sys_keyctl", "sys_add_key", "sys_shmget", "sys_ptrace", "sys_io_uring_setup", "sys_userfaultfd",
          "sys_perf_event_open", "sys_bpf", "sys_unshare", "sys_mount", "sys_process_vm_readv", "sys_memfd_create",
          "sys_kexec_load", "sys_setns", "sys_pidfd_getfd"}
_SYSCTL_LABELS = {"sysctl_core_pattern", "sysctl_nr_hugepages", "sysctl_drop_caches", "sysctl_file_max"}
MUST_FAIL = _CALLS | _SYSCTL_LABELS | {"inotify", "memfd", "proc_key_users"}
MUST_EPERM = _CALLS | {"inotify", "memfd"}
