"""The sandbox's process control: waiting without reaping, killing a run's process group, its uid's processes or its
cgroups' members, and making / removing the run's cgroups (as root). `posttrain.sandbox` says how they are used."""

import os
import secrets
import signal
import time

UID_BASE = 1 << 20  # "uid" mode: fresh uids from here on (no /etc/passwd entry needed)


def fresh_uid() -> int:
    """A uid (and gid) of its own for one run: no /etc/passwd entry, no files, no processes, no keys, and its own
    per-user kernel quotas (processes, inotify instances, key quota)."""
    return UID_BASE + secrets.randbelow(1 << 20)


def wait_unreaped(pid: int, deadline: float) -> bool:
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


def kill_group(pgid: int) -> None:
    """SIGKILL the child's process group (it leads its own session). Behind bwrap this kills bwrap, and
    with it the PID namespace and every process in it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def make_cgroups(pids: int, memory_bytes: int) -> list[str]:
    """As root: fresh cgroups for one run, `pids` tasks and `memory_bytes` of memory (page cache, tmpfs and kernel
    memory included), cgroup v1's pids and memory hierarchies or one v2 group; [] where none can be made.
    Without the pids limit a fork bomb as root filled the host's PID table (the kernel does not apply RLIMIT_NPROC to
    a user namespace root owns); without the memory limit memfd and SysV shm held more than RLIMIT_AS."""
    made = []
    name = f"posttrain-sandbox-{secrets.token_hex(6)}"
    v1 = (("/sys/fs/cgroup/pids", (("pids.max", pids),)),
          ("/sys/fs/cgroup/memory", (("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes",
                                                                              memory_bytes))))
    v2 = (("/sys/fs/cgroup", (("pids.max", pids), ("memory.max", memory_bytes), ("memory.swap.max", 0))),)
    for root, files in v1 if os.path.isdir("/sys/fs/cgroup/pids") else v2:
        path = os.path.join(root, name)
        try:
            os.mkdir(path)
        except OSError:
            continue
        made.append(path)
        for fname, value in files:
            try:
                with open(os.path.join(path, fname), "w") as f:
                    f.write(str(value))
            except OSError:  # a limit this kernel does not offer (no swap accounting): the others still hold
                pass
    return made


def remove_cgroup(path: str) -> None:
    """SIGKILL whatever is left in the run's cgroup, then remove it."""
    for _ in range(200):
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return
        sigkill(pids)
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.01)


def kill_uid(uid: int) -> None:
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
        sigkill(pids)
        time.sleep(0.01)


def sigkill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
