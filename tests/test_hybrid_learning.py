"""GRPO on a hybrid model: demo-tiny-hybrid (Qwen3.5: 3 Gated DeltaNet layers, then 1 gated full-attention layer),
trained from scratch by SFT to partial accuracy on two-digit addition, then LoRA GRPO (prefix-shared rows through the
linear layers, the sampler carrying their states) raises its greedy held-out accuracy, as test_rl_learning.py does
for the Llama-shaped demo-tiny."""

import json

from test_rl_learning import lora_grpo, rl_data, sft_to_partial_accuracy

from posttrain.evals import accuracy


def test_lora_grpo_raises_greedy_accuracy_of_a_hybrid_sft_model(tmp_path):
    model = sft_to_partial_accuracy(str(tmp_path / "sft"), model="demo-tiny-hybrid")
    prompts, pairs = rl_data(tmp_path)
    trainer = lora_grpo(tmp_path, model, prompts, steps=160, batch_size=16, log_every=40)
    assert trainer.model.cfg.family == "qwen3_5" and "linear" in trainer.model.cfg.layer_types
    before = accuracy(trainer.model, trainer.tokenizer, pairs)
    trainer.train()
    after = accuracy(trainer.model, trainer.tokenizer, pairs)
    curve = [(m["step"], round(m["reward/mean"], 3)) for m in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))]
    print(f"greedy held-out accuracy {before:.3f} -> {after:.3f}; sampled reward by step {curve}")
    assert after - before >= 0.15, (before, after, curve)
