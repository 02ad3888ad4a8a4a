"""The command line, in-process: output, exit codes, clear errors."""

import pytest

from posttrain.cli import main


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    from posttrain.tasks import demo

    out = tmp_path_factory.mktemp("demo")
    return out, demo.run(out_dir=str(out))


def test_demo_round_trips_the_checkpoint(demo_run):
    _, result = demo_run
    assert result["round_trip_exact"] is True
    assert result["params"] == 461_184  # 263*128 embed + lm_head, 2 layers of tiny-llama shape


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
