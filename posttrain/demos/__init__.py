"""The demos: users of the library, above all of it (nothing in posttrain imports them; the CLI's `demo`
command loads `demo` when it runs).

  demo.py         `posttrain demo` / `make demo`: SFT from scratch on addition -> LoRA GRPO -> DPO -> distillation
  demo_real.py    `make demo-real`: LoRA GRPO then LoRA DPO on SmolLM2-135M-Instruct, HF + GGUF exports
  real_model.py   `make real-model`: SmolLM2-135M-Instruct's GGUF, fetched reproducibly (the `real` tests use it)
  agentic.py      the tool-use learning recipe's start: `tool_arithmetic` data and a tiny model SFT-ed to call
                  the calculator sometimes (`configs/grpo_agentic.yaml`, benchmarks/agentic.py)
"""
