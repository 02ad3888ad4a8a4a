"""code_tests cannot be forged from inside the sandbox, and one sample's bad answer costs only that sample (#54).

The forgeries are those that made a wrong program score 1.0 when the tests ran inside the sandbox beside the
program (issue #54): re-reading the harness's instructions from stdin, replacing `json._default_encoder`, reaching
the harness's frames with `sys._getframe`; and the batch poison (`{"$float": 10**400}`, after which the reward
runner zeroed every sample of the batch). Each forgery is applied to a wrong `add` and must score 0; the same
tricks around a right `add` must still score 1 (a forgery that merely breaks the channel would pass the first
check and fail the second).
"""

from __future__ import annotations

import logging
import shutil

import pytest

from posttrain.rewards.functions import code_tests_reward
from posttrain.rewards.runner import score

ADD_TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert add(20, 22) == 42\n"
WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"

# name -> trick, placed after the program's `add` (the forgery of a wrong one, or noise around a right one).
TRICKS = {
    # The old harness read its spec (marker, tests) from stdin: read what stdin holds now, print an old-style
    # result line with empty records, and answer the first request ourselves.
    "stdin_reread": """
import os, sys, json
def _reply_fd():
    for fd in range(3, 64):
        try:
            if os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:') and fd != 0:
                return fd
        except OSError:
            pass
spec = os.read(0, 1 << 16)
print('#posttrain-' + '0' * 32 + ' {"records": [], "error": null}', flush=True)
fd = _reply_fd()
if fd is not None:
    os.write(fd, b'{"value": null}\\n')
""",
    # Every JSON line the harness writes becomes "true" (json.dumps goes through _default_encoder).
    "json_default_encoder": """
import json
json._default_encoder.encode = lambda o: '{"value": true}'
""",
    # Reach the harness's frame and answer every request it will read with 3 (the first expected value).
    "getframe_harness": """
import sys
def _forge():
    f = sys._getframe()
    while f is not None:
        loc = f.f_locals
        if 'reply_fd' in loc and 'write' in loc:
            for _ in range(16):
                loc['write'](loc['reply_fd'], b'{"value": 3}\\n')
            return True
        f = f.f_back
_forged = _forge()
""",
    # Print a result marker of every shape the old harness used, then exit 0 before any test could run.
    "marker_then_exit": """
import os
print('#posttrain-' + 'f' * 32 + ' {"records": [], "error": null}', flush=True)
os._exit(0)
""",
    # Return objects that claim equality with anything.
    "lying_objects": """
class _Yes(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
_real_add = add
def add(a, b):
    return _Yes(_real_add(a, b))
""",
}
# What the same trick around a right `add` scores: 1 where the channel survives it (the program answered its own
# first request and stays honest after), 0 where the trick breaks the program's own answers.
HONEST_SURVIVES = {"stdin_reread": True, "json_default_encoder": False, "getframe_harness": False,
                   "marker_then_exit": False, "lying_objects": False}
POISON = RIGHT + ("import json\njson._default_encoder.encode = "
                  "lambda o: '{\"value\": {\"$float\": ' + str(10**400) + '}}'\n")

@pytest.fixture(scope="module")
def reward():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap is missing: make setup installs it")
    return code_tests_reward(workers=2, timeout_s=5.0)


def test_forgeries_score_0_and_honest_programs_1(reward):
    names = list(TRICKS)
    wrong = reward(prompts=["p"] * len(names), completions=[WRONG + TRICKS[n] for n in names],
                   tests=[ADD_TESTS] * len(names))
    assert dict(zip(names, wrong)) == {n: 0.0 for n in names}
    honest = reward(prompts=["p"] * 4, completions=[RIGHT, RIGHT + "print('noise')\n",
                                                    RIGHT + "import os\nos.write(1, b'x' * 5000)\n",
                                                    "def add(a, b):\n    return sum((a, b))\n"],
                    tests=[ADD_TESTS] * 4)
    assert honest == [1.0] * 4
    # A right program whose trick breaks its own channel fails too: the channel, not the trick, decides.
    right = reward(prompts=["p"] * len(names), completions=[RIGHT + TRICKS[n] for n in names],
                   tests=[ADD_TESTS] * len(names))
    assert dict(zip(names, right)) == {n: float(HONEST_SURVIVES[n]) for n in names}


def test_expected_values_never_enter_the_sandbox(reward, monkeypatch):
    """The program sees the arguments of its calls and nothing else: a program that dumps everything it can read
    (stdin, its environment, its folder: the harness and itself) shows no expected value of the tests."""
    spy = ("import os, sys\ndef add(a, b):\n    seen = [repr((a, b)), repr(os.environ), *(open('/sandbox/' + n).read() "
           "for n in os.listdir('/sandbox'))]\n    sys.stdout.write('\\n'.join(seen))\n    return a + b\n")
    tests = "assert add(1, 2) == 987654321 - 987654318\n"
    runs = []
    drive = reward.box.drive
    monkeypatch.setattr(type(reward.box), "drive", lambda self, *a: runs.append(drive(*a)) or runs[-1])
    assert reward(prompts=["p"], completions=[spy], tests=[tests]) == [1.0]
    (result, passed), = runs
    assert passed is True and "(1, 2)" in result.stdout and "def _main" in result.stdout  # it did read all that
    assert "987654321" not in result.stdout and "987654318" not in result.stdout


def test_one_poisoned_sample_of_8_leaves_the_other_7_unchanged(reward, caplog):
    batch = [RIGHT, WRONG, RIGHT, WRONG, RIGHT, RIGHT, WRONG, RIGHT]
    clean = reward(prompts=["p"] * 8, completions=batch, tests=[ADD_TESTS] * 8)
    assert clean == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    poisoned = list(batch)
    poisoned[2] = POISON
    with caplog.at_level(logging.WARNING, logger="posttrain.rewards.code"):
        out = reward(prompts=["p"] * 8, completions=poisoned, tests=[ADD_TESTS] * 8)
    assert out[2] == 0.0 and out[:2] + out[3:] == clean[:2] + clean[3:]
    assert any("could not be read" in r.getMessage() for r in caplog.records), caplog.records  # logged
    # Through the reward runner, as a trainer calls it: no error, no whole-batch zero.
    rewards, keep, stats = score([reward], None, ["p"] * 8, poisoned, {"tests": [ADD_TESTS] * 8})
    assert list(rewards[:, 0]) == out and keep.all() and stats["rewards/code_tests/errors"] == 0.0
