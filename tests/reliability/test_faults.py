"""Faults during training, for every trainer through the command line: a second process on the run
folder, SIGKILL at random steps (one during an asynchronous checkpoint save), SIGTERM or Ctrl-C, a
write that fails as on a full disk, a corrupted newest checkpoint. After each fault the same command
runs again; the run must end bitwise equal to an uninterrupted run with every step logged once. Once
finished, a rerun changes nothing (and writes the final weights from the last checkpoint if they are gone).

Each trainer runs a tiny recipe (`configs/*_tiny.yaml`, 10 steps, a checkpoint every 2) in fresh
processes forked by `zygote.py`. The fault steps are drawn at random (seed: POSTTRAIN_FAULT_SEED,
else the trainer's name; the plan is printed). docs/reliability.md's fault table is rendered from a
run's measured outcomes by scripts/reliability_tables.py (`tables.record`); `test_fault_table_in_the_docs`
checks it against the fault plans.
"""

import json
import os
import random
import re
import subprocess
import sys
import zlib

import numpy as np
import pytest
from safetensors.numpy import load_file

from posttrain.recipes.lifecycle import RunLock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tables  # noqa: E402
from tables import KINDS  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
STEPS, EVERY = 10, 2
# (a fixed peak FLOP/s: each process would otherwise time a matmul for its MFU, ~1.3 s a launch)
COMMON = [f"train.steps={STEPS}", "train.log_every=1", f"checkpoint.every={EVERY}", "checkpoint.keep=2",
          "metrics.sinks=[jsonl]", "metrics.peak_flops=1e11"]
NO_EVAL = ["train.eval_every=0", "data.eval=null"]
# trainer -> (config, overrides, the polite signal it gets: SIGTERM or Ctrl-C)
RECIPES = {
    "sft": ("configs/sft_tiny.yaml", ["train.batch_size=2"], "SIGTERM"),
    "dpo": ("configs/dpo_tiny.yaml", ["train.batch_size=4", "dpo.precompute_ref=true", *NO_EVAL], "SIGINT"),
    "rm": ("configs/rm_tiny.yaml", ["train.batch_size=4", *NO_EVAL], "SIGTERM"),
    "grpo": ("configs/grpo_tiny.yaml", ["train.batch_size=2", "grpo.num_generations=4", "grpo.num_iterations=2"],
             "SIGINT"),
    "ppo": ("configs/ppo_tiny.yaml", ["train.batch_size=4", "ppo.mini_batch_size=2"], "SIGTERM"),
    "distill": ("configs/distill_tiny.yaml", ["distill.mode=on_policy", "distill.lmbda=0.5"], "SIGINT"),
}
FSIZE = 32 * 1024  # bytes a file may grow to after the failed-write fault: metrics.jsonl fits, a checkpoint does not


class Zygote:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "zygote.py")], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "ready"

    def run(self, argv, log, **faults) -> tuple[int, str]:
        """(exit code, stdout + stderr) of `posttrain ARGV` in a fresh process, with the faults."""
        self.proc.stdin.write(json.dumps({"argv": argv, "log": str(log), **faults}) + "\n")
        self.proc.stdin.flush()
        rc = int(self.proc.stdout.readline())
        return rc, open(log).read()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote():
    z = Zygote()
    yield z
    z.close()


def plan(trainer: str, seed=None) -> list[tuple[int, str]]:
    """(step, fault) in step order: 5 SIGKILLs (at least one at a checkpoint step, while its save is in
    flight), the trainer's SIGTERM or SIGINT, and one failed write (file-size limit from that step on)."""
    seed = seed if seed is not None else os.environ.get("POSTTRAIN_FAULT_SEED", trainer)
    rng = random.Random(zlib.crc32(str(seed).encode()))
    while True:
        steps = sorted(rng.sample(range(1, STEPS), 7))
        kinds = ["SIGKILL"] * 5 + [RECIPES[trainer][2], "fsize"]
        rng.shuffle(kinds)
        events = list(zip(steps, kinds))
        if any(k == "SIGKILL" and s % EVERY == 0 for s, k in events):
            return events


def _logged(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [r for r in map(json.loads, fh) if "loss" in r]


def _checkpoints(run_dir) -> list[int]:
    ck = os.path.join(run_dir, "checkpoints")
    return sorted(int(d) for d in os.listdir(ck) if d.isdigit()) if os.path.isdir(ck) else []


def _tree(folder) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = fh.read()
    return out


def _frames(out: str) -> str:
    """The `File "..."` lines of every traceback in `out`."""
    return "\n".join(ln for ln in out.splitlines() if ln.strip().startswith('File "'))


def _corrupt(run_dir) -> int:
    """Truncate every file of the newest checkpoint's train state to a third; its step."""
    step = _checkpoints(run_dir)[-1]
    for root, _, files in os.walk(os.path.join(run_dir, "checkpoints", str(step), "state")):
        for f in files:
            path = os.path.join(root, f)
            with open(path, "r+b") as fh:
                fh.truncate(os.path.getsize(path) // 3)
    return step


@pytest.mark.parametrize("trainer", list(RECIPES))
def test_faults_then_the_same_command_ends_bitwise_equal(trainer, zygote, tmp_path):
    config, extra, _ = RECIPES[trainer]
    argv = lambda run_dir: [trainer, "--config", config, f"run_dir={run_dir}", *COMMON, *extra]  # noqa: E731
    result = {"kinds": {k: [0, 0] for k in KINDS}, "lost": None}
    tally = result["kinds"]
    logs = iter(tmp_path / f"log{i}" for i in range(100))
    ref, run = tmp_path / "ref", tmp_path / "run"
    rc, out = zygote.run(argv(ref), next(logs))
    assert rc == 0, out[-3000:]

    # a second process: refused while another holds the folder, nothing written
    lock = RunLock(str(run))
    before = _tree(run)
    rc, out = zygote.run(argv(run), next(logs))
    lock.release()
    assert rc == 2 and f"another posttrain process (pid {os.getpid()}) is training in this run folder" in out, out
    assert "Traceback" not in out and _tree(run) == before
    tally["second process"] = [1, 1]

    events = plan(trainer)
    print(f"[{trainer}] fault plan (step, fault): {events}")
    for step, kind in events:
        resumed_from = _checkpoints(run)[-1] if _checkpoints(run) else 0
        corrupted = None
        if not tally["corrupt checkpoint"][0] and len(_checkpoints(run)) >= 2:  # the newest torn: the one before
            corrupted = _corrupt(run)
            resumed_from = _checkpoints(run)[-2]
            tally["corrupt checkpoint"][0] = 1
        faults = {"fsize": [step, FSIZE]} if kind == "fsize" else {"signal": [step, kind]}
        rc, out = zygote.run(argv(run), next(logs), **faults)
        # a failed write: Orbax's threads log their own errors (and asyncio its closed loop) around ours
        assert ("Traceback" not in out) if kind != "fsize" else ("/posttrain/" not in _frames(out)), out[-3000:]
        if resumed_from:
            assert f"from the checkpoint at step {resumed_from}" in out, (resumed_from, out[-3000:])
        if corrupted is not None:
            assert f"checkpoint step {corrupted} in" in out and "is unreadable" in out, out[-3000:]
        # (a failed write: tensorstore's callbacks may print between our message's first characters and Orbax's)
        errors = [ln[ln.index("posttrain:"):] for ln in out.splitlines() if "posttrain:" in ln]
        if kind == "SIGKILL":
            assert rc == -9, (rc, out[-3000:])
            tally["SIGKILL in a save" if step % EVERY == 0 else "SIGKILL"][0] += 1
        elif kind == "fsize":
            assert rc == 2 and len(errors) == 1 and "could not write the checkpoint of step" in errors[0], out[-3000:]
            kept = re.search(r"the last good checkpoint, step (\d+), is kept|no earlier checkpoint exists", errors[0])
            assert kept, errors
            good = [int(kept.group(1))] if kept.group(1) else []
            assert _checkpoints(run)[-1:] == good, (_checkpoints(run), errors)
            tally["failed write"][0] += 1
        else:
            code = {"SIGTERM": 143, "SIGINT": 130}[kind]
            assert rc == code and errors == [f"posttrain: [{trainer}] {kind}: stopped after step {step} with its "
                                             f"checkpoint in {run}/checkpoints; run the same command again to "
                                             "resume"], (rc, out[-3000:])
            assert _checkpoints(run)[-1] == step
            tally["SIGTERM / Ctrl-C"][0] += 1
    rc, out = zygote.run(argv(run), next(logs))
    assert rc == 0 and "Traceback" not in out, out[-3000:]

    a, b = load_file(str(ref / "trainable.safetensors")), load_file(str(run / "trainable.safetensors"))
    lost = sum(int(np.count_nonzero(a[k].view(np.uint8) != b[k].view(np.uint8))) for k in a if k in b)
    lost += sum(a[k].nbytes for k in a.keys() - b.keys())
    result["lost"] = lost
    assert a.keys() == b.keys() and lost == 0, (trainer, lost)
    full = {r["step"]: r["loss"] for r in _logged(ref)}
    logged = _logged(run)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))  # every step once
    assert all(r["loss"] == full[r["step"]] for r in logged)
    # finished: a rerun changes nothing, and rewrites the weights from the last checkpoint if they are gone
    os.remove(run / "trainable.safetensors")
    rc, out = zygote.run(argv(run), next(logs))
    assert rc == 0 and f"wrote trainable.safetensors from the checkpoint at step {STEPS}" in out, out[-3000:]
    assert "already finished" in out and len(_logged(run)) == STEPS
    c = load_file(str(run / "trainable.safetensors"))
    assert c.keys() == a.keys() and all(np.array_equal(a[k], c[k]) for k in a)
    for kind in KINDS[1:]:  # survived: the run ended bitwise equal to the uninterrupted one
        tally[kind][1] = tally[kind][0]
    assert tally["corrupt checkpoint"][0] == 1
    assert tally == planned_tally(trainer)  # what the doc's table says (test_fault_table_in_the_docs)
    tables.record("faults", trainer, result)


def planned_tally(trainer: str, seed=None) -> dict:
    """{kind: [injected, survived]} of a passing run of the trainer's fault plan: every fault survived."""
    events = plan(trainer, seed)
    counts = {"second process": 1, "corrupt checkpoint": 1,
              "SIGKILL": sum(k == "SIGKILL" and s % EVERY != 0 for s, k in events),
              "SIGKILL in a save": sum(k == "SIGKILL" and s % EVERY == 0 for s, k in events),
              "SIGTERM / Ctrl-C": sum(k in ("SIGTERM", "SIGINT") for _, k in events),
              "failed write": sum(k == "fsize" for _, k in events)}
    return {k: [counts[k], counts[k]] for k in KINDS}


def test_fault_table_in_the_docs():
    """docs/reliability.md's fault table (written by scripts/reliability_tables.py from a run's measured
    outcomes) is what a passing run of every trainer's fault plan measures: each fault injected as
    planned and survived, 0 bytes lost. The documented run uses each trainer's default seed (its name)."""
    _, table, _ = tables.fault_section(open(tables.DOC).read())
    expected = tables.render_faults(list(RECIPES), {t: {"kinds": planned_tally(t, seed=t), "lost": 0} for t in RECIPES})
    assert table == expected, f"{tables.DOC}: the fault table differs; run scripts/reliability_tables.py"


def test_fault_plans_cover_what_the_issue_asks():
    """Every trainer's plan: >= 5 SIGKILLs at distinct steps, one while its checkpoint save is in flight,
    one SIGTERM or Ctrl-C, one failed write, all inside the run."""
    for trainer in RECIPES:
        events = plan(trainer)
        kinds = [k for _, k in events]
        assert kinds.count("SIGKILL") >= 5 and kinds.count("fsize") == 1
        assert kinds.count("SIGTERM") + kinds.count("SIGINT") == 1
        assert any(k == "SIGKILL" and s % EVERY == 0 for s, k in events)
        assert [s for s, _ in events] == sorted({s for s, _ in events}) and 0 < events[0][0] and events[-1][0] < STEPS


@pytest.mark.parametrize("async_save", [False, True])
def test_a_failed_save_names_its_step_and_the_last_good_checkpoint(tmp_path, async_save):
    """The storage refuses the save of step 4 (synchronous: that save raises; asynchronous: it surfaces at
    the next save or at close): one PosttrainError naming step 4 and step 2, which stays readable."""
    import jax.numpy as jnp

    from posttrain.errors import PosttrainError
    from posttrain.train.checkpoint import Checkpointer

    state = {"w": jnp.arange(4.0)}
    ck = Checkpointer(str(tmp_path / "ck"), keep=3, async_save=async_save)
    ck.save(2, state, {"pos": 2})
    ck.manager.wait_until_finished()
    real_save, real_wait = ck.manager.save, ck.manager.wait_until_finished
    failing = {}

    def save(step, **kw):
        if not async_save:
            raise ValueError("OUT_OF_RANGE: Failed writing: File too large [os_error_code='27']")
        failing["step"] = step  # asynchronous: the save starts, its background write fails later
        return real_save(step, **kw)

    def wait():
        real_wait()
        if failing.pop("step", None) == 4:
            raise ValueError("OUT_OF_RANGE: Failed writing: File too large [os_error_code='27']")

    ck.manager.save, ck.manager.wait_until_finished = save, wait
    with pytest.raises(PosttrainError, match=r"could not write the checkpoint of step 4 .* File too large.*"
                                             r"the last good checkpoint, step 2, is kept"):
        ck.save(4, state, {"pos": 4})
        ck.save(6, state, {"pos": 6})  # asynchronous: the failure of step 4 surfaces here
    ck.close()  # raises nothing more
    assert ck.restore(2, state)[1] == {"pos": 2}
