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
    """`posttrain demo --quick` end to end (the full demo is `make demo`): SFT, GRPO, DPO and distillation
    each scored on the held-out questions and exported; summary.json, the table and the report."""
    import json

    import jax

    from posttrain.models import count_params, from_pretrained

    assert main(["demo", "--out", str(tmp_path), "--quick"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and str(tmp_path / "summary.json") in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    stages = summary["stages"]
    assert [s["stage"] for s in stages] == ["sft", "grpo", "dpo", "distill"]
    # accuracy is the share of the 200 held-out questions, and the line printed after each stage says the same
    assert all(abs(s["accuracy"] * 200 - round(s["accuracy"] * 200)) < 1e-9 and s["seconds"] > 0 for s in stages)
    assert all(f"[demo] {s['stage']}: held-out accuracy {s['accuracy']:.1%}" in out for s in stages)
    assert [s["kl"] is None for s in stages] == [True, True, True, False] and stages[-1]["kl"] >= 0
    assert summary["total_seconds"] >= sum(s["seconds"] for s in stages) - 1
    # the device the stages ran on, named in the summary and the closing line (the tests' 8 host devices)
    assert summary["device"] == f"cpu ({len(jax.devices())} devices)" and f"s on {summary['device']};" in out
    sizes = {}
    for s in stages:
        model = from_pretrained(str(tmp_path / s["stage"] / "hf"))
        sizes[s["stage"]] = count_params(model)
        assert model.cfg.vocab_size == 263
    assert sizes["distill"] < sizes["dpo"] == sizes["sft"]  # the student is smaller
    assert (tmp_path / "data" / "pairs.jsonl").exists()
    assert (tmp_path / "distill" / "report" / "report.html").exists()
    page = (tmp_path / "report" / "report.html").read_text()  # one page: every stage's evaluation curves
    assert page.count("<h2>Stage ") == 4 and "Sampled answers (pass@k, maj@k)" in page
    evals = [r for r in map(json.loads, open(tmp_path / "grpo" / "metrics.jsonl")) if "eval_pass@1" in r]
    assert evals and {"eval_pass@8", "eval_maj@8"} <= set(evals[-1])  # the GRPO stage's eval.k: 8


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


def test_demo_runs_its_float32_matmuls_at_full_precision_on_a_tpu(monkeypatch):
    """On a TPU the demo sets JAX's default matmul precision to "highest" for its stages and restores it after
    (float32 operands otherwise pass through bfloat16 there); on a CPU it leaves the setting alone."""
    import jax

    from posttrain.demos import demo

    seen = []
    monkeypatch.setattr(demo, "_run", lambda *a: seen.append(jax.config.jax_default_matmul_precision) or {})
    demo.run("unused")
    monkeypatch.setattr(demo.jax, "default_backend", lambda: "tpu")
    demo.run("unused")
    assert seen == [None, "highest"] and jax.config.jax_default_matmul_precision is None
