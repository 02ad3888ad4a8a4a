"""Multi-turn tool episodes on the shared sampler (posttrain/agentic/rollout.py, Sampler.begin / extend) and
their GRPO wiring: sampler and trainer log-probabilities agree over whole multi-turn episodes, tool
outputs never enter the loss, a stopped row continues exactly on its extended cache, episodes are
reproducible from a seed, finished episodes leave the batch, the calculator's output is what the
episode holds, and the `env:` / `tools:` config sections.

Cheap on purpose: a 2-layer model, 12-token actions, and every jitted program shared between tests
(the same prompts, batch and sampling parameters)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain import config as C
from posttrain.agentic.config import EnvSection, ToolsSection, make_env_factory
from posttrain.agentic.env import ToolEnv
from posttrain.agentic.parsing import format_tool_call, render_tool_result
from posttrain.agentic.rollout import AgenticRollout, run_episodes
from posttrain.data.prompts import tokenize_prompt
from posttrain.errors import PosttrainError
from posttrain.generate import Completions, SamplingParams
from posttrain.models import Transformer, preset, save_pretrained
from posttrain.tokenizer import byte_tokenizer
from posttrain.train import merge
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

TOK = byte_tokenizer()
# the GRPO trainer's parameters for grpo.num_generations 3, max_new_tokens 12, temperature 0.7
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.7, n=3, stop_ids=TOK.eos_ids)
ROWS = [{"prompt": f"Q{k}: {'ab' * k}?", "k": k} for k in range(4)]
WIDTH = 96  # env.max_tokens


class EchoEnv:
    """A scripted environment: prompt k's episodes take 1 + k % 3 actions, each observation a text of
    its own length; the reward is the last action's length mod 3."""

    def reset(self, row):
        self.turns, self.limit = 0, 1 + int(row["k"]) % 3
        return row["prompt"]

    def step(self, action):
        self.turns += 1
        if self.turns >= self.limit:
            return None, float(len(action) % 3), True
        return f"\n[obs {self.turns}: " + "x" * (5 * self.turns + self.limit) + "]\n", 0.0, False


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """`posttrain grpo` with env.enabled on a random tiny-student (its HF folder) and ROWS, set up (state,
    sampler, rollout), with the scripted environment in place of the config's ToolEnv."""
    cfg = preset("tiny-student", vocab_size=TOK.vocab_size)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)  # weights from numpy, norms 1: no compiled initialiser (values do not matter)

    def init(path, x):
        norm = any("norm" in str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        return jnp.ones(x.shape, x.dtype) if norm else jnp.asarray(rng.normal(0, 0.05, x.shape).astype(x.dtype))

    model = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, abstract))
    out = tmp_path_factory.mktemp("agentic")
    hf = save_pretrained(model, str(out / "hf"), tokenizer=TOK)
    (out / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = C.from_dict(GRPOConfig, {
        "model": {"path": hf}, "data": {"train": str(out / "prompts.jsonl"), "max_prompt_length": 16},
        "grpo": {"num_generations": SAMPLED.n, "max_new_tokens": SAMPLED.max_new_tokens, "temperature": 0.7},
        "env": {"enabled": True, "max_turns": 3, "max_tokens": WIDTH}, "tools": {"names": ["calculator"]},
        "optim": {"lr": 1e-3, "schedule": "constant"}, "train": {"steps": 1, "batch_size": 4},
        "run_dir": str(out / "run")})
    t = GRPOTrainer(config, progress=False)
    assert t.length == 304 and t.width == WIDTH  # a row: the prompt, then 3 episode slots of 96 tokens
    t.make_env = EchoEnv
    t.parts = t.setup()
    return t


def test_episodes_masks_parity_and_dropout(trainer):
    """Episodes of 1-3 actions in GRPO rows: every observation token has loss weight 0 and every sampled
    token 1; at the first of μ iterations the GRPO loss's own log-probs equal the sampler's over every
    sampled token of the multi-turn episodes (logp_mismatch_max <= 1e-5); each round decodes only the
    episodes still running."""
    parts = trainer.parts
    sampler, rollout, n = parts.batches.sampler, parts.batches, SAMPLED.n
    assert rollout.params == SAMPLED
    calls = []
    extend = sampler.extend

    def spy(turn, rows, *a, **kw):
        calls.append(len(rows))
        return extend(turn, rows, *a, **kw)

    sampler.extend = spy
    try:
        batch = rollout(parts.state)
    finally:
        del sampler.extend
    eps = rollout.last_episodes
    assert sorted({e.turns for e in eps}) == [1, 2, 3] and calls == [2 * n, n]  # prompts k=1, 2; then k=2

    def prompt_k(b):  # the row's prompt (branch 0, BOS dropped by decode) -> its k
        text = TOK.decode(batch["tokens"][b][(batch["branch_ids"][b] == 0) & (batch["segment_ids"][b] != 0)].tolist())
        return next(r["k"] for r in ROWS if r["prompt"] == text)

    for e, k in zip(eps, [prompt_k(i // n) for i in range(len(eps))]):
        assert e.turns == 1 + k % 3
        text = TOK.decode([t for t, m in zip(e.ids, e.mask) if not m])
        assert text == "".join(f"\n[obs {t}: " + "x" * (5 * t + 1 + k % 3) + "]\n" for t in range(1, e.turns))
    w = batch["score_w"].reshape(len(ROWS), n, WIDTH)
    for i, e in enumerate(eps):
        np.testing.assert_array_equal(w[i // n, i % n, :len(e.ids)], e.mask)
        assert not w[i // n, i % n, len(e.ids):].any()
    loss = jax.jit(lambda st, b: trainer.loss_fn(merge(parts.graphdef, st), b)[1]["logp_mismatch_max"])
    gap = float(loss(parts.state, {k: jnp.asarray(v) for k, v in batch.items()}))
    mask = batch["score_w"] != 0
    print(f"max |trainer - sampler| log-prob over {int(mask.sum())} sampled tokens of multi-turn episodes: {gap:.2e}")
    assert gap <= 1e-5


def test_stop_sequence_then_extend_continues_exactly(trainer):
    """Greedy: a row stops at a stop sequence (kept in its output); `extend` with nothing appended then
    samples exactly what the uninterrupted decode of the same prompt sampled: the cache was extended,
    never recomputed."""
    sampler = trainer.parts.batches.sampler
    ids = [list(p.ids) for p in trainer.prompts]  # the rollout's prompts: its prefill program
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0, n=3)
    never = [[10**6, 10**6]]  # the same [1, 2] stop-sequence shape as below: one compiled program
    ref, _ = sampler.begin(ids, greedy, stop_sequences=never)
    assert set(ref.finish_reasons) == {"length"}
    seq = ref.tokens[0, 4:6].tolist()
    first, turn = sampler.begin(ids, greedy, stop_sequences=[seq])
    L = int(first.lengths[0])
    assert L <= 6 and first.finish_reasons[0] == "stop" and first.tokens[0, L - 2:L].tolist() == seq
    np.testing.assert_array_equal(first.tokens[0, :L], ref.tokens[0, :L])
    again, _ = sampler.extend(turn, [0], [[]], dataclasses.replace(greedy, n=1), max_new_tokens=[12 - L],
                              stop_sequences=never)
    np.testing.assert_array_equal(again.tokens[0, :12 - L], ref.tokens[0, L:])
    np.testing.assert_allclose(again.logprobs[0, :12 - L], ref.logprobs[0, L:], atol=1e-5, rtol=0)


def test_episodes_are_reproducible_from_a_seed(trainer):
    """The GRPO batch source: the same seed gives the same episodes and rows, another seed others."""
    parts = trainer.parts

    def rollout(seed):
        return AgenticRollout(trainer.prompts, TOK, parts.batches.sampler, parts.graphdef, make_env=EchoEnv,
                              batch_size=4, n=SAMPLED.n, params=SAMPLED, length=trainer.length, max_tokens=WIDTH,
                              max_turns=3, seed=seed)

    a, b, c = rollout(7), rollout(7), rollout(8)
    xa, xb, xc = a(parts.state), b(parts.state), c(parts.state)
    for k in xa:
        np.testing.assert_array_equal(xa[k], xb[k])
    assert not np.array_equal(xa["tokens"], xc["tokens"])
    assert [e.ids for e in a.last_episodes] == [e.ids for e in b.last_episodes]
    stats = a.metrics()
    assert {"reward/mean", "episode/turns", "episode/tool_use_rate", "time/tools_s"} <= set(stats)


class ScriptedSampler:
    """Stands in for the Sampler: row r's i-th action is `script[r][i]` (text), with log-prob -0.5 a token.
    Records what `extend` was given."""

    pad_id = 0

    def __init__(self, script, width=256):
        self.script, self.width, self.appended = script, width, []

    def _out(self, rows, turns):
        texts = [self.script[r][t] for r, t in zip(rows, turns)]
        toks = np.zeros((len(rows), self.width), np.int32)
        lengths = np.zeros(len(rows), np.int32)
        for j, text in enumerate(texts):
            ids = TOK.encode(text, add_special_tokens=False) + ([] if text.endswith("</tool_call>") else [TOK.eos_id])
            toks[j, :len(ids)], lengths[j] = ids, len(ids)
        return Completions(toks, np.where(toks != 0, -0.5, 0.0).astype(np.float32), lengths,
                           ["stop"] * len(rows), np.asarray(rows))

    def begin(self, prompts, params, **kw):
        self.rows = list(range(len(prompts) * params.n))
        self.turns = [0] * len(self.rows)
        return self._out(self.rows, self.turns), None

    def extend(self, turn, rows, appended, params, **kw):
        self.appended.append([TOK.decode(a) for a in appended])
        self.rows = [self.rows[j] for j in rows]
        self.turns = [self.turns[j] + 1 for j in rows]
        return self._out(self.rows, self.turns), None


def test_calculator_episodes_from_the_config_sections():
    """ToolEnv from env: / tools: (the calculator): a call runs the calculator and its rendered output is
    appended (untrained); a malformed call gets an error observation; an answer without a call ends the
    episode; the verifier scores the final answer; running out of max_tokens truncates; a failing
    verifier costs its episode only."""
    rows = [{"prompt": "Compute 437*829. Use the calculator.\n", "answer": "362273"},
            {"prompt": "Compute 12*34. Use the calculator.\n", "answer": "408"}]
    call = format_tool_call("calculator", {"expression": "437*829"})
    script = [[call, "#### 362273"], ["#### 400"], ['<tool_call>{"name": calc</tool_call>', "#### 408"],
              [call + " " * 150 + "</tool_call>", "#### 362273"]]
    make_env = make_env_factory(EnvSection(enabled=True, max_turns=3, max_tokens=256), ToolsSection())
    prompts = [tokenize_prompt(rows[i], "row", TOK, 64) for i in (0, 1, 1, 0)]
    sampler = ScriptedSampler(script)
    eps = run_episodes(sampler, TOK, prompts, make_env, SamplingParams(max_new_tokens=256, stop_ids=TOK.eos_ids),
                       key=jax.random.key(0), max_tokens=256, max_turns=3)
    assert [e.reward for e in eps] == [1.0, 0.0, 1.0, 0.0]
    assert [(e.turns, e.tool_calls, e.parse_errors, e.truncated) for e in eps] == [
        (2, 1, 0, False), (1, 0, 0, False), (2, 0, 1, False), (1, 1, 0, True)]
    assert sampler.appended[0][0] == render_tool_result("362273") and sampler.appended[0][1].startswith(
        "\n<tool_response>\nError: could not parse the tool call")
    e = eps[0]
    assert TOK.decode(e.ids) == call + render_tool_result("362273") + "#### 362273"
    assert TOK.decode([t for t, m in zip(e.ids, e.mask) if not m]) == render_tool_result("362273")
    assert e.logprobs == [-0.5 if m else 0.0 for m in e.mask]
    # a verifier that raises ends its episode with reward 0, counted, never the rollout
    broken = run_episodes(ScriptedSampler([["#### 1"]]), TOK, prompts[:1], lambda: ToolEnv([], lambda r, f: 1 / 0),
                          SamplingParams(max_new_tokens=256, stop_ids=TOK.eos_ids), key=jax.random.key(0),
                          max_tokens=256, max_turns=3)
    assert broken[0].env_error and broken[0].reward == 0.0


@pytest.mark.parametrize("over, words", [
    ({"env.enabled": True, "grpo.rewards": {"last_number": 1.0}}, "grpo.rewards is not used with env.enabled"),
    ({"env.max_turns": 0}, "env.max_turns must be >= 1"),
    ({"tools.names": ["abacus"]}, "unknown tool 'abacus'"),
    ({"env.verifier": "nope"}, "unknown verifier 'nope'"),
    ({"tools.python.timeout_s": 0}, "tools.python.timeout_s must be > 0"),
    ({"env.format": "mistral"}, "'env.format' must be one of"),
    ({"env.enabled": True, "grpo.dynamic_sampling": True}, "not supported with env.enabled"),
])
def test_bad_env_and_tools_settings_name_the_key(over, words):
    d = {"model": {"preset": "demo-tiny"}, "data": {"train": "x.jsonl"}}
    for k, v in over.items():
        node = d
        *path, leaf = k.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = v
    with pytest.raises(PosttrainError, match=words):
        C.from_dict(GRPOConfig, d)
