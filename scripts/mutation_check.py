"""Mutation check of the parity tests: does each test that names a model feature see it?

For each feature below, a child process wraps the ModelConfig translation (`posttrain.models.hf.config_from_hf`,
what `from_pretrained` reads a checkpoint with) so the feature is removed or perturbed, then runs the parity tests
that name it (a `pytest -k` selection) against the untouched transformers reference. A mutation is caught when
pytest reports failed tests (exit code 1); anything else (all passed, collection error, no test selected) is a
miss. The unmutated selection must pass first (`baseline`). Exit code: the number of misses.

    .venv/bin/python scripts/mutation_check.py               # every mutation, a Markdown table at the end
    .venv/bin/python scripts/mutation_check.py attn_softcap  # some of them

The table is in docs/testing.md. Single process (-p no:xdist): about 15 s to a minute a row on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = "tests/"


def _rope(cfg, **kw):
    """Both RoPE configs (full and sliding layers) with `kw` replaced where they are set."""
    out = {"rope": dataclasses.replace(cfg.rope, **kw)}
    if cfg.rope_local is not None:
        out["rope_local"] = dataclasses.replace(cfg.rope_local, **kw)
    return out


def _no_scaling(kind):
    def mutate(cfg):
        out = {}
        for field in ("rope", "rope_local"):
            r = getattr(cfg, field)
            if r is not None and r.kind == kind:
                out[field] = dataclasses.replace(r, kind="default", factor=1.0)
        return out
    return mutate


# name -> (what the mutation does, fields to replace given the translated config, pytest arguments)
MUTATIONS = {
    "attn_softcap": ("attention scores not soft-capped (attn_softcap=None)", lambda c: {"attn_softcap": None},
                     [T + "test_models.py", "-k", "test_logits_match_transformers and gemma2"]),
    "final_softcap": ("output logits not soft-capped (final_softcap=None)", lambda c: {"final_softcap": None},
                      [T + "test_models.py", "-k", "test_logits_match_transformers and gemma2"]),
    "rope_llama3": ("llama3 RoPE scaling read as plain RoPE", _no_scaling("llama3"),
                    [T + "test_models.py", "-k", "test_logits_match_transformers and llama"]),
    "rope_linear": ("linear RoPE scaling (Gemma 3 global layers) read as plain RoPE", _no_scaling("linear"),
                    [T + "test_models.py", "-k", "test_logits_match_transformers and gemma3"]),
    "rope_yarn": ("YaRN RoPE scaling (gpt-oss) read as plain RoPE", _no_scaling("yarn"),
                  [T + "test_gpt_oss.py", "-k", "test_logits_match_transformers_with_right_padding and 11"]),
    "rope_proportional": ("proportional RoPE (Gemma 4 global layers) read as plain RoPE", _no_scaling("proportional"),
                          [T + "test_gemma4.py", "-k", "test_logits_match_transformers"]),
    "rope_theta": ("RoPE base frequency x 2 (every family)", lambda c: _rope(c, theta=c.rope.theta * 2),
                   [T + "test_models.py", "-k", "test_logits_match_transformers and (qwen2 or mistral)"]),
    "partial_rotary": ("partial rotary (Qwen3.5: 1/4 of the head) rotates the whole head",
                       lambda c: _rope(c, partial=1.0),
                       [T + "test_qwen3_5.py", "-k", "test_logits_match_transformers_with_right_padding and 11"]),
    "sliding_window": ("sliding window ignored (sliding_window=None, every layer full)",
                       lambda c: {"sliding_window": None, "layer_types": ()} if c.sliding_window else {},
                       [T + "test_models.py", "-k", "test_logits_match_transformers and (mistral or gemma2)"]),
    "sliding_window_off_by_one": ("sliding window one token wider",
                                  lambda c: {"sliding_window": c.sliding_window + 1} if c.sliding_window else {},
                                  [T + "test_models.py", "-k",
                                   "test_logits_match_transformers and (mistral or gemma2 or gemma3)"]),
    "qk_norm": ("q/k RMSNorm skipped (qk_norm=False; the norm weights are then unused)",
                lambda c: {"qk_norm": False},
                [T + "test_models.py", "-k", "test_logits_match_transformers and qwen3"]),
    "qkv_bias": ("q/k/v biases dropped (qkv_bias=False)", lambda c: {"qkv_bias": False},
                 [T + "test_models.py", "-k", "test_logits_match_transformers and qwen2"]),
    "tied_embeddings": ("tied output head read as untied (tie_embeddings=False)",
                        lambda c: {"tie_embeddings": False},
                        [T + "test_models.py", "-k", "test_logits_match_transformers and qwen2"]),
    "moe_norm_topk": ("MoE top-k routing weights renormalised or not, flipped (norm_topk_prob)",
                      lambda c: {"norm_topk_prob": not c.norm_topk_prob} if c.num_experts else {},
                      [T + "test_moe.py", "-k", "test_logits_and_router_logits_match_transformers"]),
    "gemma_unit_norm": ("Gemma RMSNorm scales by w instead of (1 + w) (norm_unit_offset=False)",
                        lambda c: {"norm_unit_offset": False},
                        [T + "test_models.py", "-k", "test_logits_match_transformers and gemma"]),
    "query_scale": ("Gemma 2/3 query_pre_attn_scalar ignored (query_scale=None: head_dim ** -0.5)",
                    lambda c: {"query_scale": None},
                    [T + "test_models.py", "-k", "test_logits_match_transformers and gemma3"]),
}

def _skip_dpo_stage():
    """The demo's DPO exports (HF folder and GGUF) taken from the GRPO run: the GGUF holds the GRPO model."""
    import posttrain.runs as runs

    export_run, export_run_gguf = runs.export_run, runs.export_run_gguf

    def grpo(run_dir):
        return run_dir[:-len("dpo")] + "grpo" if run_dir.rstrip("/").endswith("dpo") else run_dir

    runs.export_run = lambda run_dir, out, *a, **kw: export_run(grpo(run_dir), out, *a, **kw)
    runs.export_run_gguf = lambda run_dir, path, *a, **kw: export_run_gguf(grpo(run_dir), path, *a, **kw)


# name -> (what the mutation does, a function patching posttrain in the child, pytest arguments)
PATCHES = {
    "dpo_stage_skipped": ("demo-real: the DPO stage's exports are the GRPO run's", _skip_dpo_stage,
                          [T + "test_gguf.py", "-k", "test_demo_real_quick_path"]),
}

CHILD = """
import dataclasses, sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {scripts!r})
import mutation_check as m
import posttrain.models.hf as hf
name = {name!r}
if name in m.PATCHES:
    m.PATCHES[name][1]()
original = hf.config_from_hf
def mutated(*a, **kw):
    cfg = original(*a, **kw)
    return dataclasses.replace(cfg, **m.MUTATIONS[name][1](cfg)) if name in m.MUTATIONS else cfg
hf.config_from_hf = mutated
import pytest
sys.exit(pytest.main({args!r}))
"""


def run(name: str, args: list[str]) -> tuple[int, str, float]:
    code = CHILD.format(root=ROOT, scripts=os.path.join(ROOT, "scripts"), name=name,
                        args=args + ["-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rf", "--no-header"])
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    out = p.stdout + p.stderr
    return p.returncode, out, time.time() - t0


def summary(out: str) -> str:
    """The failed tests pytest names, shortened, and the last line of its summary."""
    failed = [re.sub(r"^FAILED tests/", "", line).split(" - ")[0] for line in out.splitlines()
              if line.startswith("FAILED ")]
    tail = [line.strip("= ") for line in out.splitlines() if line.startswith("=") or " passed" in line
            or " failed" in line]
    return (", ".join(failed[:3]) + (f" (+{len(failed) - 3})" if len(failed) > 3 else "")), (tail[-1] if tail else "")


def main(names: list[str]) -> int:
    every = {**MUTATIONS, **PATCHES}
    names = names or list(every)
    unknown = [n for n in names if n not in every]
    if unknown:
        sys.exit(f"mutation_check: unknown {unknown}; known: {', '.join(every)}")
    rows, misses = [], 0
    selections = []
    for n in names:
        if every[n][2] not in selections:
            selections.append(every[n][2])
    for args in selections:  # the untouched model passes every selection used
        rc, out, dt = run("baseline", args)
        if rc != 0:
            print(out[-3000:])
            sys.exit(f"mutation_check: the unmutated selection {' '.join(args)} does not pass (exit {rc})")
        print(f"baseline {' '.join(args)}: passes ({summary(out)[1]}, {dt:.0f} s)", flush=True)
    for n in names:
        what, _, args = every[n]
        rc, out, dt = run(n, args)
        failed, tail = summary(out)
        caught = rc == 1
        misses += not caught
        rows.append((n, what, f"{args[0].replace(T, '')} -k '{args[2]}'",
                     "caught" if caught else f"MISSED (exit {rc})", failed or tail))
        print(f"{n}: {rows[-1][3]} by {failed or tail} ({dt:.0f} s)", flush=True)
    print("\n| mutation | what | tests run | result | failing tests |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return misses


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
