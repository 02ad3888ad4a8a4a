"""The JSON-lines channel between the trainer and a program it drives in the sandbox (`Sandbox.drive`)."""

import json
import os
import select
import time
from typing import Any


class Channel:
    """`ask(obj)`: one JSON line to the program, the next JSON line back (see `Sandbox.drive`), within a deadline."""

    def __init__(self, write_fd: int, read_fd: int, deadline: float, max_bytes: int):
        self.write_fd, self.read_fd, self.deadline, self.max_bytes, self.buffer = write_fd, read_fd, deadline, \
            max_bytes, b""
        os.set_blocking(write_fd, False)

    def _wait(self, fd: int, write: bool) -> None:
        left = self.deadline - time.monotonic()
        ready = select.select([], [fd], [], max(left, 0)) if write else select.select([fd], [], [], max(left, 0))
        if not any(ready):
            raise TimeoutError("sandbox: the program did not answer within the time limit")

    def __call__(self, obj: Any) -> Any:
        data = (json.dumps(obj) + "\n").encode()
        while data:
            self._wait(self.write_fd, True)
            data = data[os.write(self.write_fd, data):]
        while b"\n" not in self.buffer:
            if len(self.buffer) > self.max_bytes:
                raise ValueError(f"sandbox: the program's answer is longer than {self.max_bytes} bytes")
            self._wait(self.read_fd, False)
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise EOFError("sandbox: the program closed its channel (it exited or was killed)")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)
