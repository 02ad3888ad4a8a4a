"""The one exception type for errors a user can cause.

Bad config keys, bad data rows, missing files, incompatible checkpoints: each raises
`PosttrainError` with a message that names the file, line or key and says how to fix it.
The CLI prints the message without a traceback and exits with code 2. Bugs inside
posttrain raise ordinary Python exceptions instead.
"""


class PosttrainError(Exception):
    """A problem with the user's input (config, data, files); the message says how to fix it."""


class RunStopped(Exception):
    """A run stopped on a signal (SIGTERM, Ctrl-C) after checkpointing its current step; the CLI prints
    the message and exits 128 + the signal number."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why
