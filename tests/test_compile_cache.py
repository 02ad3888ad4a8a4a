"""The CLI's persistent compilation cache (posttrain/compile_cache.py): a second `generate` loads the prefill
from disk and prints the same text; `off` and a user's own JAX cache folder are respected."""

import os
import subprocess
import sys

import pytest

HIT = "Persistent compilation cache hit for 'jit__prefill_fn'"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from flax import nnx

    from posttrain.models import Transformer, preset, save_pretrained
    from posttrain.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    folder = tmp_path_factory.mktemp("cc") / "tiny"
    save_pretrained(Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0)), str(folder),
                    tokenizer=tok)
    return folder


def _generate(folder, **env):
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "POSTTRAIN_COMPILE_CACHE",
                                                             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    base.update(env, JAX_LOGGING_LEVEL="DEBUG")
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "generate", "--model", str(folder), "--prompt",
                          "hello", "--max-new-tokens", "6"], env=base, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, out.stderr


def test_second_run_loads_the_compiled_programs(tiny, tmp_path):
    import jaxlib

    first, log1 = _generate(tiny, POSTTRAIN_COMPILE_CACHE=str(tmp_path / "c"))
    (folder,) = (tmp_path / "c").iterdir()  # one folder per jaxlib version and host CPU
    assert folder.name.startswith(f"jaxlib-{jaxlib.__version__}-")
    assert any(p.name.startswith("jit__prefill_fn-") for p in folder.iterdir())
    assert HIT not in log1
    second, log2 = _generate(tiny, POSTTRAIN_COMPILE_CACHE=str(tmp_path / "c"))
    assert HIT in log2 and second == first


def test_off_and_a_users_jax_cache_are_respected(tiny, tmp_path):
    home = tmp_path / "home"
    _generate(tiny, POSTTRAIN_COMPILE_CACHE="off", XDG_CACHE_HOME=str(home))
    assert not home.exists()
    _generate(tiny, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "mine"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              XDG_CACHE_HOME=str(home))
    assert not home.exists() and any((tmp_path / "mine").iterdir())
    _generate(tiny, XDG_CACHE_HOME=str(home))  # the default place
    assert list((home / "posttrain" / "xla").iterdir())
