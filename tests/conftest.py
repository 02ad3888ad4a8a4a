"""Test setup: 8 virtual CPU devices (for sharding tests), offline Hugging Face, shared fixtures."""

import os
import tempfile

# 8 virtual CPU devices. (LLVM's backend optimisations off, --xla_backend_optimization_level=0, made
# compile-bound tests 15-25 % faster but moved the float round-off enough that the shared SFT start of
# the RL learning tests began at 41.5 % instead of ~30 %, leaving GRPO / PPO too little to gain.)
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# JAX's persistent compilation cache, shared by the xdist workers and every subprocess a test starts
# (the CLI kill/resume and multi-process tests compile the same programs again in each process): a
# folder of this test run only, so nothing carries over between runs. Compiled programs are keyed on
# the program, the flags and the JAX version; a cache hit is the same executable.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"posttrain-jax-cache-{os.environ.get('PYTEST_XDIST_TESTRUNUID') or os.getpid()}"))
# Every program, not only those that compile for over a second (JAX's default): the random initialisers
# compile once per parameter shape (0.4-2 s each) and the subprocess tests build the same models again.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import sys  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))

from hf_models import FAMILIES, make_checkpoint  # noqa: E402


@pytest.fixture
def x64():
    """float64 inside a test only (`pytestmark = pytest.mark.usefixtures("x64")`); the rest of the
    suite keeps JAX's float32 default."""
    import jax

    with jax.enable_x64(True):
        yield


def nested(d: dict, over: dict) -> dict:
    """`d` with dotted-key overrides applied in place ({"train.steps": 4} sets d["train"]["steps"])."""
    for k, v in over.items():
        node = d
        *path, leaf = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    return d


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> folder of a tiny random HF checkpoint (built once per test session)."""
    root = tmp_path_factory.mktemp("hf")
    return {fam: make_checkpoint(fam, root / fam) for fam in FAMILIES}


def _sft_to_partial_accuracy(out_dir, low: float = 0.3) -> str:
    """SFT demo-tiny from scratch on two-digit addition until its greedy held-out accuracy first
    reaches `low` (checked every 50 steps from step 150; the float round-off of the machine moves
    where a fixed step count lands, so the start is set by accuracy); a HF folder in `out_dir`."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from posttrain import config as C
    from posttrain.data import batches, load_examples
    from posttrain.generate import Sampler, SamplingParams
    from posttrain.losses import sft_loss
    from posttrain.models import Transformer, preset, save_pretrained
    from posttrain.tasks import addition
    from posttrain.tokenizer import byte_tokenizer
    from posttrain.train import init_state, make_optimizer, make_train_step, merge, schedule

    train, evals = addition.make_pairs(digits=2, seed=0, n_eval=200)
    pairs = [(r["prompt"], r["completion"]) for r in evals]
    tok = byte_tokenizer()
    examples, _ = load_examples(addition.write_jsonl(train, os.path.join(out_dir, "train.jsonl")), tok, max_length=16)
    optim = C.OptimSection(lr=1.5e-3, warmup_steps=20, schedule="constant")
    opt = make_optimizer(optim, schedule(optim, 1000))
    graphdef, state = init_state(Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), opt)
    step = make_train_step(sft_loss, opt, graphdef)
    data = iter(batches(examples, batch_size=64, seq_len=16, pad_id=tok.pad_id, packing=False, seed=0))
    prompts = [tok.encode(p) for p, _ in pairs]
    sampler = Sampler(merge(graphdef, state), max_len=max(map(len, prompts)) + 8)
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, stop_ids=tok.eos_ids)
    for i in range(1, 601):
        state, _ = step(state, {k: jnp.asarray(v) for k, v in next(data).items()})
        if i >= 150 and i % 50 == 0:
            sampler.update(merge(graphdef, state))
            texts = sampler.generate(prompts, greedy).texts(tok)
            acc = float(np.mean([t.strip() == a for t, (_, a) in zip(texts, pairs)]))
            if acc >= low:
                break
    print(f"SFT start: {i} steps, greedy held-out accuracy {acc:.3f}")
    return save_pretrained(merge(graphdef, state), os.path.join(out_dir, "hf"), tokenizer=tok)


@pytest.fixture(scope="session")
def sft_addition(tmp_path_factory, worker_id):
    """A HF folder of demo-tiny SFT-ed on addition to partial accuracy (the RL learning tests' start).
    Built once per test run: pytest-xdist workers share it through a file lock in the run's folder."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if worker_id != "master":  # .../pytest-N/popen-gwK: the parent is this run's, shared by the workers
        root = root.parent
    out = root / "sft_addition"
    with FileLock(str(root / "sft_addition.lock")):
        if not (out / "hf" / "config.json").exists():
            out.mkdir(exist_ok=True)
            _sft_to_partial_accuracy(str(out))
    return str(out / "hf")


# The files that take longest, longest first. `make test` gives whole files to its two workers in this
# order (`--dist loadfile --no-loadscope-reorder`: a module's fixtures are built once), so the long ones
# start first and neither worker finishes minutes after the other. Order from `--durations=0`.
LONGEST_FIRST = ["test_faults.py", "test_docs.py", "test_distill.py", "test_ppo.py", "test_grpo.py", "test_cli.py",
                 "test_dpo.py", "test_attention.py", "test_branches.py", "test_moe.py", "test_agentic_rollout.py",
                 "test_gemma4.py", "test_multiprocess_sft.py", "test_sharding.py", "test_models.py",
                 "test_pipeline.py", "test_generate.py", "test_reward_model.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


def pytest_sessionfinish(session):
    """The run's compilation cache folder goes with the run (the xdist controller removes it)."""
    import shutil

    if not hasattr(session.config, "workerinput"):
        path = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
        if os.path.basename(path).startswith("posttrain-jax-cache-"):
            shutil.rmtree(path, ignore_errors=True)
