"""The command line, in-process: output, exit codes, clear errors."""

import pytest

from posttrain.cli import main


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A tiny byte-tokenizer checkpoint folder (config.json, safetensors, tokenizer files)."""
    from flax import nnx

    from posttrain.models import Transformer, preset, save_pretrained
    from posttrain.tokenizer import byte_tokenizer

    out = tmp_path_factory.mktemp("ckpt")
    tok = byte_tokenizer()
    model = Transformer(preset("demo-tiny", vocab_size=tok.vocab_size), rngs=nnx.Rngs(0))
    save_pretrained(model, str(out / "tiny-checkpoint"), tokenizer=tok)
    return out, model


def test_demo_command_trains_evaluates_and_exports(tmp_path, capsys):
    """`posttrain demo` end to end with few steps (the full demo is `make demo`)."""
    from posttrain.models import from_pretrained

    assert main(["demo", "--out", str(tmp_path), "--steps", "20"]) == 0
    out = capsys.readouterr().out
    assert "accuracy before training: 0.0%" in out and "accuracy after 20 SFT steps" in out
    model = from_pretrained(str(tmp_path / "hf"))
    assert model.cfg.vocab_size == 263 and (tmp_path / "run" / "trainable.safetensors").exists()


def test_generate_chat_with_n_samples(demo_run, capsys):
    out, _ = demo_run
    rc = main(["generate", "--model", str(out / "tiny-checkpoint"), "--prompt", "hi", "--chat", "--n", "3",
               "--temperature", "0.9", "--max-new-tokens", "5"])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln[:4] for ln in lines] == ["[0] ", "[1] ", "[2] "]


@pytest.mark.parametrize("argv, needle", [
    (["--model", "{missing}", "--prompt", "x"], "does not exist"),
    (["--model", "{ckpt}", "--prompt", "x", "--max-new-tokens", "0"], "max_new_tokens must be > 0"),
    (["--model", "{ckpt}", "--prompt", "x", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["--model", "{ckpt}", "--prompt", ""], "--prompt is empty"),
])
def test_generate_errors_exit_2(demo_run, capsys, tmp_path, argv, needle):
    out, _ = demo_run
    argv = [a.format(missing=tmp_path / "nope", ckpt=out / "tiny-checkpoint") for a in argv]
    assert main(["generate"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posttrain: error:") and needle in err and "Traceback" not in err
