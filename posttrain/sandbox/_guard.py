"""The sandbox's child process: `python -I -B _guard.py WORK ENTRY MEM CPU FSIZE NOFILE NPROC GUARD`.

What it is: a standalone script (it imports nothing from posttrain) that, before any user code runs,
sets resource limits on its own process (address space, CPU seconds, file size, open files,
processes/threads, no core dumps), then installs a `sys.addaudithook` guard, then executes ENTRY (a
read-only program file: the model's program, or the code-tests harness) in a fresh namespace with
WORK as the only writable folder.
The guard refuses: opening files outside WORK (reads are also allowed inside the interpreter's
stdlib and site-packages folders, which imports need), listing folders outside those, changing the
working folder, creating symlinks, every `socket.*` event (so no connection, bind, DNS lookup),
process creation (`os.system`, `os.fork`, `os.exec*`, `os.posix_spawn`, `subprocess.Popen`, and the
raw `_posixsubprocess.fork_exec`), signalling other processes, building code objects by hand,
every use of `ctypes` (it may be imported, as numpy does, but not used), raising resource limits,
and the gc / frame introspection calls that could reach the guard.

Why the limits are set here and not in the parent's `preexec_fn`: the parent is a JAX process with
many threads, and CPython documents `preexec_fn` as unsafe (it can deadlock) in a threaded
parent. Setting the limits as the child's first statements has the same effect on user code.

What it is not: the security boundary. Audit hooks see only what CPython itself audits; native code
(a C extension, a crafted `marshal` payload, an interpreter bug) or a rewritten closure can do
anything the OS lets the process do. The boundary is the OS one around this process (bubblewrap's
namespaces, see posttrain/sandbox/__init__.py); this guard is defence in depth.
"""

import sys


def _install(work: str, box: str, mem: int, cpu: int, fsize: int, nofile: int, nproc: int, audit: bool) -> None:
    import os
    import pathlib
    import resource
    import signal
    import sysconfig

    for limit, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                         (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
        if value >= 0:
            hard = value + 1 if limit == resource.RLIMIT_CPU else value  # SIGXCPU at the soft limit, SIGKILL 1 s on
            resource.setrlimit(limit, (value, hard))
    # A write past the file-size limit then fails with OSError (reported) instead of killing the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    if not audit:  # the OS boundary alone (tests of that boundary)
        return
    # The raw fork+exec primitive is not audited: replace it before anything can import it.
    import _posixsubprocess

    def _no_fork_exec(*_a, **_k):
        raise PermissionError("sandbox: starting processes is not allowed")

    _posixsubprocess.fork_exec = _no_fork_exec

    # Everything the guard uses is bound now, so user code that later patches `os`, `builtins` or
    # `pathlib` cannot change what the guard computes.
    _lstat, _readlink, _getcwd = os.lstat, os.readlink, os.getcwd
    _str, _bytes, _int, _type, _isinstance, _any, _all = str, bytes, int, type, isinstance, any, all
    _OSError = OSError
    _str_add, _bytes_decode = str.__add__, bytes.decode
    _Denied = PermissionError
    _path_types = (pathlib.PosixPath, pathlib.PurePosixPath)
    _pp_dict, _sub_dicts = pathlib.PurePath.__dict__, tuple(c.__dict__ for c in (pathlib.Path, *_path_types))
    _orig_fspath, _orig_str = _pp_dict["__fspath__"], _pp_dict["__str__"]
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    work_root = os.path.realpath(work) + "/"
    read_roots = tuple(sorted({os.path.realpath(sysconfig.get_paths()[k]) + "/"
                               for k in ("stdlib", "platstdlib", "purelib", "platlib")}
                              | {os.path.realpath(box) + "/"}))
    S_IFMT, S_IFLNK = 0o170000, 0o120000

    def text(path) -> str:
        """The path as an exact str, read from the object's buffer (a str subclass cannot lie
        through overridden methods); PathLike only as an unpatched pathlib path."""
        t = _type(path)
        if _isinstance(path, _str):
            return _str_add("", path)
        if _isinstance(path, _bytes):
            return _bytes_decode(path, "utf-8", "surrogateescape")
        if (t in _path_types and _pp_dict["__fspath__"] is _orig_fspath and _pp_dict["__str__"] is _orig_str
                and _all("__fspath__" not in d and "__str__" not in d for d in _sub_dicts)):
            return _str_add("", _orig_str(path))
        raise _Denied("sandbox: paths must be str, bytes or pathlib paths")

    def resolve(path) -> str:
        """The absolute path with every symlink followed and '.'/'..' applied (realpath, from bound
        primitives only)."""
        p = text(path)
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        todo, parts, links = p.split("/")[::-1], [], 0
        while todo:
            c = todo.pop()
            if c == "" or c == ".":
                continue
            if c == "..":
                if parts:
                    parts.pop()
                continue
            cur = "/" + "/".join(parts) + ("/" if parts else "") + c
            try:
                mode = _lstat(cur).st_mode
            except _OSError:
                mode = 0
            if mode & S_IFMT == S_IFLNK:
                links += 1
                if links > 40:
                    raise _Denied("sandbox: too many symbolic links")
                target = _readlink(cur)
                if target.startswith("/"):
                    parts = []
                todo.extend(target.split("/")[::-1])
            else:
                parts.append(c)
        return "/" + "/".join(parts) + "/"  # trailing "/" so a root matches itself and never a sibling prefix

    def inside(path, roots) -> bool:
        if _isinstance(path, _int):  # an already-open descriptor: its opening was checked
            return True
        r = resolve(path)
        return _any(r.startswith(root) for root in roots)

    writable, readable = (work_root,), (work_root, *read_roots)
    refused = frozenset({
        "os.system", "os.fork", "os.forkpty", "os.exec", "os.spawn", "os.posix_spawn", "subprocess.Popen",
        "pty.spawn", "os.startfile", "os.kill", "os.killpg", "signal.pthread_kill", "os.chdir", "os.symlink",
        "code.__new__", "resource.setrlimit", "resource.prlimit", "gc.get_objects", "gc.get_referrers",
        "gc.get_referents", "sys._current_frames", "sys.setprofile", "sys.settrace", "os.chroot",
        "webbrowser.open", "os.setxattr", "os.removexattr"})
    one_path_write = frozenset({"os.mkdir", "os.rmdir", "os.remove", "os.chmod", "os.chown", "os.truncate",
                                "os.utime", "os.chflags", "os.lchflags", "os.lchmod", "os.mkfifo", "os.mknod"})
    one_path_read = frozenset({"os.listdir", "os.scandir", "os.getxattr", "os.listxattr", "os.fwalk", "os.walk"})
    refused_imports = frozenset({"_posixsubprocess"})

    def guard(event: str, args) -> None:
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            write = (_isinstance(mode, _str) and _any(ch in mode for ch in "wax+")) or (
                _isinstance(flags, _int) and (flags & write_flags) != 0)
            if not inside(path, writable if write else readable):
                raise _Denied(f"sandbox: access to {text(path) if not _isinstance(path, _int) else path!r} "
                              "is not allowed (only the working folder is)")
        elif event == "ctypes.dlopen" and args[0] is None:
            return  # `import ctypes` opens the main program (numpy imports ctypes); every use of it is refused
        elif event in refused or event.startswith("socket.") or event.startswith("ctypes."):
            what = "network access" if event.startswith("socket.") else event
            raise _Denied(f"sandbox: {what} is not allowed")
        elif event == "import":
            if args[0] in refused_imports:
                raise _Denied(f"sandbox: importing {args[0]} is not allowed")
        elif event in one_path_write:
            if not inside(args[0], writable):
                raise _Denied(f"sandbox: {event} outside the working folder is not allowed")
        elif event in one_path_read:
            if args[0] is not None and not inside(args[0], readable):
                raise _Denied(f"sandbox: {event} outside the working folder is not allowed")
        elif event in ("os.rename", "os.link"):
            if not (inside(args[0], writable) and inside(args[1], writable)):
                raise _Denied(f"sandbox: {event} outside the working folder is not allowed")

    sys.addaudithook(guard)


def _report(exc: BaseException, traceback) -> None:
    """Print the traceback without this script's frames (the guard's and _main's): the model should
    see its own program's lines."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__, lookup_lines=False)
    todo, seen = [te], set()
    while todo:
        t = todo.pop()
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        t.stack = traceback.StackSummary.from_list([f for f in t.stack if f.filename != __file__])
        todo += [t.__cause__, t.__context__]
    sys.stderr.write("".join(te.format()))


def _main() -> int:
    import os

    work, entry, (mem, cpu, fsize, nofile, nproc, audit) = sys.argv[1], sys.argv[2], (int(a) for a in sys.argv[3:9])
    with open(entry, encoding="utf-8") as f:  # read before the guard exists
        source = f.read()
    import traceback  # imported now: the error path must not need an import under a tight memory limit

    code = compile(source, os.path.basename(entry), "exec")  # a SyntaxError here is the user's: reported below
    _install(work, os.path.dirname(entry), mem, cpu, fsize, nofile, nproc, bool(audit))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
    except MemoryError:
        namespace.clear()  # free what the program held so the report can be written
        sys.stderr.write(f"MemoryError: the memory limit ({mem // 2**20} MB) was exceeded\n")
        sys.stderr.flush()
        return 3
    except SystemExit:
        raise
    except BaseException as exc:
        _report(exc, traceback)
        return 1
    return 0


if __name__ == "__main__":
    try:
        status = _main()
    except SyntaxError:
        import traceback

        traceback.print_exc(limit=0)
        status = 1
    sys.stdout.flush()
    sys.exit(status)
