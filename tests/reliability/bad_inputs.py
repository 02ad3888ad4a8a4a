"""The bad-input catalogue's cases (issue #15): each breaks one thing in a valid tiny setup.

Run by tests/reliability/test_bad_input.py; `{t}` is the case's scratch folder, `{cfg}` the repository's
configs/, `{hf}` / `{small}` the shared model folders of that file's `models` fixture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Union

REPO = Path(__file__).resolve().parents[2]
SFT_TINY = (REPO / "configs" / "sft_tiny.yaml").read_text()
TRAIN_LINE = SFT_TINY.splitlines().index("train:") + 1  # where sft_tiny.yaml opens its train section

File = Union[str, Callable[[Path], None]]  # text (placeholders filled in), or a writer of the path


@dataclass(frozen=True)
class Case:
    id: str
    category: str
    what: str  # the bad input, in words (the table's "input" column)
    argv: tuple  # `posttrain` arguments; {t} = the case's folder, {hf} / {small} = the shared model folders
    expect: tuple  # fragments the message must hold (placeholders filled in)
    files: dict = field(default_factory=dict)  # path under {t} -> File
    xfail: str = ""  # a known gap, with its reason: the case runs as a strict xfail


# ----------------------------------------------------------------------------- file writers


def tokenizer_folder(extra: dict | None = None) -> Callable[[Path], None]:
    """A folder with the byte tokenizer's files (and `extra` files: name -> text)."""

    def write(path: Path) -> None:
        from posttrain.tokenizer import byte_tokenizer

        byte_tokenizer().save_pretrained(path)
        for name, text in (extra or {}).items():
            (path / name).write_text(text)

    return write


LLAMA = dict(model_type="llama", vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
             rms_norm_eps=1e-5, tie_word_embeddings=False)


def model_folder(config: dict | str | None, weights: Callable[[Path], None] | None = None) -> Callable[[Path], None]:
    """A model folder with the byte tokenizer, `config` as config.json (a dict, or raw text), and `weights`."""

    def write(path: Path) -> None:
        tokenizer_folder()(path)
        if config is not None:
            (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
        if weights is not None:
            weights(path / "model.safetensors")

    return write


def truncated_weights(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"model.embed_tokens.weight": np.zeros((264, 64), np.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a copy that stopped half-way


def foreign_weights(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"encoder.weight": np.zeros((4, 4), np.float32)}, str(path))  # readable, but another model's


def run_folder(config: dict, weights: bytes | None = None) -> Callable[[Path], None]:
    """A run folder: config.yaml (`config` on top of sft_tiny.yaml, model = the shared {hf} folder) and,
    if given, `weights` as its trainable.safetensors."""

    def write(path: Path) -> None:
        import yaml

        cfg = yaml.safe_load(SFT_TINY)
        cfg["model"] = {"path": "{hf}"}
        for key, value in config.items():
            cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        if weights is not None:
            (path / "trainable.safetensors").write_bytes(weights)

    return write


def encoded(text: str, encoding: str) -> Callable[[Path], None]:
    """A file holding `text` in `encoding` (UTF-16 writes its byte-order mark, as Notepad does)."""
    return lambda path: path.write_bytes(text.encode(encoding))


def index_folder(shard: str) -> Callable[[Path], None]:
    """A model folder whose model.safetensors.index.json names `shard` as a tensor's file."""

    def write(path: Path) -> None:
        model_folder(LLAMA)(path)
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard}}))

    return write


_LISTENERS: list = []  # sockets of the port-in-use case, kept open for the rest of the session


def config_with_busy_port(path: Path) -> None:
    """SFT_TINY with a Prometheus exporter on a port another socket of this process already listens on."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    _LISTENERS.append(sock)
    port = sock.getsockname()[1]
    path.write_text(SFT_TINY + f"metrics:\n  sinks: [jsonl, prometheus]\n  prometheus_port: {port}\n")


def pipeline(stages: str, head: str = "model: demo-tiny\n") -> str:
    """A pipeline file's text: run_dir in the case's folder, `head`, then `stages` (YAML list items)."""
    return "run_dir: {t}/run\n" + head + "stages:\n" + stages


# ----------------------------------------------------------------------------- the catalogue

RUN = "run_dir={t}/run"
SFT = ("sft", "--config", "configs/sft_tiny.yaml", RUN)
DPO = ("dpo", "--config", "configs/dpo_tiny.yaml", RUN, "data.eval=null", "train.eval_every=0")
GRPO = ("grpo", "--config", "configs/grpo_tiny.yaml", RUN)
PPO = ("ppo", "--config", "configs/ppo_tiny.yaml", RUN)
HF = ("model.preset=null", "model.path={t}/model")
SFT_STAGE = "  - recipe: sft\n    config: {cfg}/sft_tiny.yaml\n"
CASES = [
    # --- run configs
    Case("config-unknown-key", "config", "override of a misspelt key (optim.lrr)",
         SFT + ("optim.lrr=1e-3",), ("command line: unknown key 'optim.lrr'", "did you mean 'lr'?")),
    Case("config-unknown-section", "config", "misspelt top-level section in the YAML file (trian:)",
         ("sft", "--config", "{t}/bad.yaml", RUN), ("bad.yaml: unknown key 'trian'", "did you mean 'train'?"),
         {"bad.yaml": SFT_TINY.replace("\ntrain:", "\ntrian:")}),
    Case("config-wrong-type", "config", "override with a value of the wrong type (train.steps=ten)",
         SFT + ("train.steps=ten",), ("'train.steps' must be int, got 'ten'",)),
    Case("config-quoted-bool", "config", "quoted boolean in the YAML file (packing: 'yes')",
         ("sft", "--config", "{t}/bad.yaml", RUN),
         ("bad.yaml: 'data.packing' must be bool", "write true or false without quotes"),
         {"bad.yaml": SFT_TINY.replace("packing: false", "packing: 'yes'")}),
    Case("config-bad-choice", "config", "value outside a key's choices (optim.schedule=cosin)",
         SFT + ("optim.schedule=cosin",), ("'optim.schedule' must be one of 'constant', 'linear', 'cosine'",)),
    Case("config-bad-value", "config", "out-of-range value in the YAML file (lora.rank: 0)",
         ("sft", "--config", "{t}/bad.yaml", RUN), ("bad.yaml: lora.rank must be >= 1, got 0",),
         {"bad.yaml": SFT_TINY + "lora:\n  rank: 0\n"}),
    Case("config-inconsistent", "config", "micro-batch that does not divide the batch (3 of 4)",
         SFT + ("train.micro_batch_size=3",), ("train.micro_batch_size (3) must divide train.batch_size (4)",)),
    Case("config-missing-section", "config", "config file without a data section",
         ("sft", "--config", "{t}/bad.yaml", RUN), ("bad.yaml: missing required key 'data.train'", "data.train=..."),
         {"bad.yaml": "model: {preset: demo-tiny}\n"}),
    Case("config-missing-model", "config", "config file without a model section",
         ("sft", "--config", "{t}/bad.yaml", RUN),
         ("bad.yaml: set exactly one of model.path", "or model.preset"),
         {"bad.yaml": "data: {train: tests/data/sft_text.jsonl}\n"}),
    Case("config-override-no-equals", "config", "override without '=' (train.steps)",
         SFT + ("train.steps",), ("override 'train.steps' has no '='", "key=value")),
    Case("config-override-bad-yaml", "config", "override whose value is broken YAML (train.steps=[1)",
         SFT + ("train.steps=[1",), ("cannot parse the value of 'train.steps=[1' as YAML", "quote strings")),
    Case("config-override-too-deep", "config", "override below a plain value (train.steps.max=1)",
         SFT + ("train.steps.max=1",), ("'train.steps' is a value, not a section", "use train.steps=...")),
    Case("config-yaml-syntax", "config", "YAML syntax error (bad indentation)",
         ("sft", "--config", "{t}/bad.yaml", RUN), ("bad.yaml:3:2: YAML syntax error", "fix the file at that line"),
         {"bad.yaml": "model:\n  preset: demo-tiny\n data: {train: x.jsonl}\n"}),
    Case("config-not-a-mapping", "config", "config file holding a list",
         ("sft", "--config", "{t}/bad.yaml", RUN), ("bad.yaml: the top level must be a mapping of keys",),
         {"bad.yaml": "- model\n- data\n"}),
    Case("config-missing-file", "config", "--config naming a file that does not exist",
         ("sft", "--config", "{t}/nope.yaml", RUN), ("cannot read config file", "nope.yaml", "check the path")),
    Case("config-no-config-flag", "config", "`posttrain sft` without --config",
         ("sft",), ("posttrain sft: error: the following arguments are required: --config",)),
    Case("config-eval-without-data", "config", "train.eval_every without data.eval",
         SFT + ("train.eval_every=5",), ("train.eval_every is set but data.eval is not", "train.eval_every=0")),
    Case("config-debug-traceback", "config", "`posttrain --debug` with a misspelt key: the traceback is shown",
         ("--debug",) + SFT + ("optim.lrr=1e-3",), ("Traceback", "command line: unknown key 'optim.lrr'")),
    # --- datasets
    Case("data-missing-file", "data", "data.train naming a file that does not exist",
         SFT + ("data.train={t}/missing.jsonl",), ("data path", "missing.jsonl does not exist", "point the dataset")),
    Case("data-bad-json-line", "data", "JSONL file whose 2nd line is cut off",
         SFT + ("data.train={t}/rows.jsonl",), ("rows.jsonl:2: the line is not valid JSON", "fix or delete that line"),
         {"rows.jsonl": '{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", \n'}),
    Case("data-json-array", "data", "a pretty-printed JSON array saved as .json",
         SFT + ("data.train={t}/rows.json",), ("rows.json:1:", "looks like one JSON array", "one object per line"),
         {"rows.json": '[{"text": "a"},\n {"text": "b"}]\n'}),
    Case("data-missing-column", "data", "prompt/completion row without its completion",
         SFT + ("data.train={t}/rows.jsonl",), ("rows.jsonl:1: the row has a 'prompt' field but no 'completion'",),
         {"rows.jsonl": '{"prompt": "1+1="}\n'}),
    Case("data-unknown-format", "data", "row with no recognised field (2nd line)",
         SFT + ("data.train={t}/rows.jsonl",), ("rows.jsonl:2: no recognised field", "each row must be"),
         {"rows.jsonl": '{"text": "fine"}\n{"question": "1+1=", "answer": "2"}\n'}),
    Case("data-bad-message", "data", "chat message without a role",
         SFT + ("data.train={t}/rows.jsonl",), ("rows.jsonl:1: messages[0] has no 'role' string", '"role": "user"'),
         {"rows.jsonl": '{"messages": [{"content": "hi"}]}\n'}),
    Case("data-empty-file", "data", "empty JSONL file",
         SFT + ("data.train={t}/empty.jsonl",), ("empty.jsonl: no usable examples (rows=0",), {"empty.jsonl": ""}),
    Case("data-unknown-extension", "data", "data file with an unknown extension (.csv)",
         SFT + ("data.train={t}/rows.csv",), ("unknown extension '.csv'", "use a .jsonl"), {"rows.csv": "a,b\n"}),
    Case("data-not-a-dataset-folder", "data", "data.train naming a plain folder",
         SFT + ("data.train={t}/rows",), ("is a folder but not one written by datasets' save_to_disk",),
         {"rows/notes.txt": "not a dataset\n"}),
    Case("data-row-too-long", "data", "row longer than max_length with truncation=error",
         SFT + ("data.max_length=8", "data.train={t}/rows.jsonl"),
         ("rows.jsonl:1: the row is", "more than max_length=8", "set truncation to 'keep_start'"),
         {"rows.jsonl": '{"prompt": "a long prompt", "completion": " and a long answer"}\n'}),
    Case("data-pref-missing-rejected", "data", "preference row without 'rejected' (dpo)",
         DPO + ("data.train={t}/pairs.jsonl",), ("pairs.jsonl:1: the row has no 'rejected' column",),
         {"pairs.jsonl": '{"prompt": "2?", "chosen": " even"}\n'}),
    Case("data-pref-identical", "data", "preference pair with identical answers (dpo)",
         DPO + ("data.train={t}/pairs.jsonl",), ("pairs.jsonl:1: 'chosen' and 'rejected' are identical",),
         {"pairs.jsonl": '{"prompt": "2?", "chosen": " even", "rejected": " even"}\n'}),
    Case("data-pref-mixed-formats", "data", "preference row mixing messages and strings (dpo)",
         DPO + ("data.train={t}/pairs.jsonl",),
         ("pairs.jsonl:1: 'rejected' is a str but 'chosen' is a list", "must all be strings or all lists"),
         {"pairs.jsonl": '{"prompt": "2?", "chosen": [{"role": "assistant", "content": "even"}], '
                         '"rejected": " odd"}\n'}),
    Case("data-pref-too-long", "data", "preference pair longer than max_length with truncation=error (dpo)",
         DPO + ("data.max_length=8", "data.train={t}/pairs.jsonl"),
         ("pairs.jsonl:1: prompt (", "raise data.max_length, or set data.truncation to 'truncate'"),
         {"pairs.jsonl": '{"prompt": "2?", "chosen": " even, since it ends in 2", "rejected": " odd"}\n'}),
    Case("data-rl-no-prompt", "data", "RL row without a prompt column (grpo)",
         GRPO + ("data.train={t}/prompts.jsonl",), ("prompts.jsonl:1: the row has no 'prompt' column",),
         {"prompts.jsonl": '{"question": "1+1=", "answer": "2"}\n'}),
    Case("data-rl-prompt-too-long", "data", "prompt longer than data.max_prompt_length (grpo)",
         GRPO + ("data.max_prompt_length=4",),
         ("grpo_addition.jsonl:1: the prompt is", "more than data.max_prompt_length=4", "raise it")),
    # --- model folders
    Case("model-missing-folder", "model", "model.path naming a folder that does not exist (posttrain plan)",
         ("plan", "--config", "configs/sft_tiny.yaml") + HF, ("model: model folder does not exist",)),
    Case("model-missing-folder-train", "model", "model.path naming a folder that does not exist (posttrain sft)",
         SFT + HF, ("model: model folder does not exist",)),
    Case("model-no-config", "model", "model folder without config.json",
         SFT + HF, ("model/config.json: missing", "save_pretrained"), {"model": model_folder(None)}),
    Case("model-corrupt-config", "model", "model folder whose config.json is not JSON",
         SFT + HF, ("model/config.json: invalid JSON",), {"model": model_folder('{"model_type": "llama", ')}),
    Case("model-unsupported-type", "model", "model folder of an unsupported model_type (bert)",
         SFT + HF, ("model_type 'bert'", "is not supported; posttrain loads llama"),
         {"model": model_folder({"model_type": "bert"})}),
    Case("model-no-weights", "model", "model folder without safetensors weights",
         SFT + HF, ("model: no model.safetensors or model.safetensors.index.json", "convert .bin files"),
         {"model": model_folder(LLAMA)}),
    Case("model-truncated-weights", "model", "model folder with a truncated model.safetensors",
         SFT + HF, ("model.safetensors: truncated safetensors file", "copy the file again"),
         {"model": model_folder(LLAMA, truncated_weights)}),
    Case("model-foreign-weights", "model", "model folder whose weights belong to another model",
         SFT + HF, ("tensor 'model.embed_tokens.weight' is missing from the checkpoint", "does not match its config"),
         {"model": model_folder(LLAMA, foreign_weights)}),
    Case("model-gemma4-multimodal", "model", "multimodal gemma4 folder without model.text_only",
         SFT + HF, ("model_type 'gemma4' is a multimodal Gemma 4 folder", "model.text_only: true"),
         {"model": model_folder({"model_type": "gemma4", "text_config": {}, "vision_config": {"hidden_size": 8}})}),
    Case("model-gemma4-multimodal-generate", "model", "multimodal gemma4 folder in `posttrain generate`",
         ("generate", "--model", "{t}/model", "--prompt", "hi"), ("multimodal Gemma 4 folder", "--text-only"),
         {"model": model_folder({"model_type": "gemma4", "text_config": {}, "vision_config": {"hidden_size": 8}})}),
    Case("model-tokenizer-too-large", "model", "tokenizer with more tokens (263) than the model's vocabulary (97)",
         SFT + ("model.preset=null", "model.path={small}", "model.tokenizer={hf}"),
         ("model.tokenizer has 263 tokens but the model's vocabulary is 97", "use the model's own tokenizer")),
    Case("model-max-length-beyond-positions", "model", "data.max_length beyond the model's positions (300 > 256)",
         SFT + ("model.preset=null", "model.path={hf}", "data.max_length=300"),
         ("data.max_length=300 exceeds the model's maximum position 256", "lower data.max_length")),
    Case("model-unknown-preset", "model", "misspelt model.preset (demo-tiy)",
         SFT + ("model.preset=demo-tiy",), ("unknown model preset 'demo-tiy'", "'demo-tiny'")),
    # --- tokenizers
    Case("tokenizer-missing-folder", "tokenizer", "model.tokenizer naming a folder that does not exist",
         SFT + ("model.tokenizer={t}/tok",), ("tokenizer folder", "tok does not exist", "holding tokenizer.json")),
    Case("tokenizer-no-files", "tokenizer", "model.tokenizer naming a folder without tokenizer files",
         SFT + ("model.tokenizer={t}/tok",), ("tok has no tokenizer files", "tokenizer.json"),
         {"tok/README.md": "no tokenizer here\n"}),
    Case("tokenizer-broken-json", "tokenizer", "tokenizer.json that is not JSON",
         SFT + ("model.tokenizer={t}/tok",), ("could not load the tokenizer in", "tokenizer.json"),
         {"tok/tokenizer.json": "{not json"}),
    Case("tokenizer-bad-eos", "tokenizer", "generation_config.json with a text eos_token_id",
         SFT + ("model.tokenizer={t}/tok",),
         ("generation_config.json: eos_token_id must be an int or a list of ints",),
         {"tok": tokenizer_folder({"generation_config.json": '{"eos_token_id": "</s>"}'})}),
    # --- reward functions
    Case("reward-unknown-name", "reward", "misspelt built-in reward (mth_answer)",
         GRPO + ("grpo.rewards={mth_answer: 1.0}",),
         ("grpo.rewards: unknown reward 'mth_answer'", "use math_answer")),
    Case("reward-missing-module", "reward", "reward 'module:function' whose module does not exist",
         GRPO + ("grpo.rewards={'no_such_module:score': 1.0}",),
         ("grpo.rewards: cannot import 'no_such_module:score'", "No module named 'no_such_module'")),
    Case("reward-missing-function", "reward", "reward 'module:function' whose function does not exist",
         GRPO + ("grpo.rewards={'json:no_such_function': 1.0}",),
         ("grpo.rewards: cannot import 'json:no_such_function'", "has no attribute 'no_such_function'")),
    Case("reward-not-callable", "reward", "reward 'module:function' naming a constant (math:pi)",
         GRPO + ("grpo.rewards={'math:pi': 1.0}",), ("grpo.rewards: 'math:pi' is not a function",)),
    Case("reward-wrong-signature", "reward", "reward function with a wrong signature, f(completions) (grpo)",
         GRPO + ("grpo.rewards={'bad_signature_reward:reward': 1.0}",),
         ("grpo.rewards: 'bad_signature_reward:reward' cannot take a reward function's arguments",
          "def f(prompts, completions, **kwargs)"),
         {"bad_signature_reward.py": "def reward(completions):\n    return [0.0] * len(completions)\n"}),
    Case("reward-wrong-signature-ppo", "reward", "reward function missing a data column, f(prompts, completions) (ppo)",
         PPO + ("ppo.rewards={'bad_signature_reward2:reward': 1.0}",),
         ("ppo.rewards: 'bad_signature_reward2:reward' cannot take", "unexpected keyword argument"),
         {"bad_signature_reward2.py": "def reward(prompts, completions):\n    return [0.0] * len(prompts)\n"}),
    Case("reward-format-without-pattern", "reward", "format reward without grpo.format_pattern",
         GRPO + ("grpo.rewards={format: 1.0}",), ("grpo.rewards names 'format' but grpo.format_pattern is not set",)),
    Case("reward-nan-weight", "reward", "reward weight .nan",
         GRPO + ("grpo.rewards={math_answer: .nan}",),
         ("grpo.rewards.math_answer: the weight must be a finite number",)),
    # --- pipeline files
    Case("pipeline-unknown-task", "pipeline", "stage of an unknown kind (recipe: sfft)",
         ("run", "{t}/p.yaml"), ("p.yaml:4: stages[0].recipe must be one of", "did you mean 'sft'?"),
         {"p.yaml": pipeline("  - recipe: sfft\n    config: {cfg}/sft_tiny.yaml\n")}),
    Case("pipeline-missing-stage-ref", "pipeline", "stage whose model refers to a stage that does not exist",
         ("run", "{t}/p.yaml"), ("p.yaml:6 (stage 'dpo'): 'model.path' is '@sft2'", "no earlier stage is named 'sft2'"),
         {"p.yaml": pipeline(SFT_STAGE + "  - recipe: dpo\n    config: {cfg}/dpo_tiny.yaml\n    model: '@sft2'\n")}),
    Case("pipeline-cycle", "pipeline", "two stages that take each other's model (a cycle)",
         ("run", "{t}/p.yaml"), ("p.yaml:4 (stage 'a'): 'model.path' is '@b'", "no earlier stage is named 'b'"),
         {"p.yaml": pipeline("  - {recipe: sft, name: a, config: {cfg}/sft_tiny.yaml, model: '@b'}\n"
                             "  - {recipe: sft, name: b, config: {cfg}/sft_tiny.yaml, model: '@a'}\n")}),
    Case("pipeline-duplicate-name", "pipeline", "two stages with the same name",
         ("run", "{t}/p.yaml"), ("p.yaml:6: two stages are named 'sft'", "give each a different 'name'"),
         {"p.yaml": pipeline(SFT_STAGE + SFT_STAGE)}),
    Case("pipeline-unknown-top-key", "pipeline", "misspelt top-level key (stagez)",
         ("run", "{t}/p.yaml"), ("p.yaml: unknown key 'stagez'", "did you mean 'stages'?"),
         {"p.yaml": "run_dir: {t}/run\nmodel: demo-tiny\nstagez: []\n"}),
    Case("pipeline-stage-bad-key", "pipeline", "stage with a misspelt config key (train.stepz)",
         ("run", "{t}/p.yaml"), ("p.yaml:4 (stage 'sft'): unknown key 'train.stepz'", "did you mean 'steps'?"),
         {"p.yaml": pipeline(SFT_STAGE + "    train: {stepz: 3}\n")}),
    Case("pipeline-override-bad-type", "pipeline", "stage override with a wrong type (sft.train.steps=ten)",
         ("run", "{t}/p.yaml", "sft.train.steps=ten"), ("p.yaml:4 (stage 'sft'): 'train.steps' must be int",),
         {"p.yaml": pipeline(SFT_STAGE)}),
    Case("pipeline-override-unknown-stage", "pipeline", "override of a stage that does not exist",
         ("run", "{t}/p.yaml", "sfft.train.steps=3"), ("command line: unknown key 'sfft'", "did you mean 'sft'?"),
         {"p.yaml": pipeline(SFT_STAGE)}),
    Case("pipeline-override-bad-yaml", "pipeline", "stage override whose value is broken YAML",
         ("run", "{t}/p.yaml", "sft.train.steps=[1"),
         ("cannot parse the value of 'sft.train.steps=[1' as YAML", "quote strings"), {"p.yaml": pipeline(SFT_STAGE)}),
    Case("pipeline-missing-stage-config", "pipeline", "stage whose config file does not exist",
         ("run", "{t}/p.yaml"), ("p.yaml:4 (stage 'sft'): cannot read its config file", "nothere.yaml"),
         {"p.yaml": pipeline("  - recipe: sft\n    config: nothere.yaml\n")}),
    Case("pipeline-no-model", "pipeline", "first stage without any model",
         ("run", "{t}/p.yaml"), ("p.yaml:3 (stage 'sft'): no model: give the pipeline's 'model'",),
         {"p.yaml": pipeline("  - recipe: sft\n    data: {train: tests/data/sft_text.jsonl}\n", head="")}),
    Case("pipeline-stage-run-dir", "pipeline", "stage that sets its own run_dir",
         ("run", "{t}/p.yaml"), ("'run_dir' is set by the pipeline", "set the pipeline's run_dir instead"),
         {"p.yaml": pipeline(SFT_STAGE + "    run_dir: elsewhere\n")}),
    Case("pipeline-missing-file", "pipeline", "pipeline file that does not exist",
         ("run", "{t}/nope.yaml"), ("cannot read pipeline file", "nope.yaml", "check the path")),
    # --- checkpoints and run folders
    Case("checkpoint-export-not-a-run", "checkpoint", "`posttrain export --run` of a folder that is not a run",
         ("export", "--run", "{t}/run", "--out", "{t}/out"),
         ("run/config.yaml: missing", "--run must be a folder written by a posttrain trainer"),
         {"run/notes.txt": "not a run\n"}),
    Case("checkpoint-export-unfinished", "checkpoint", "`posttrain export --run` of a run without its weights",
         ("export", "--run", "{t}/run", "--out", "{t}/out"),
         ("run/trainable.safetensors: weights file is missing", "was the run finished?"),
         {"run": run_folder({"run_dir": "{t}/run"})}),
    Case("checkpoint-export-corrupt-weights", "checkpoint", "`posttrain export --run` of a run with corrupt weights",
         ("export", "--run", "{t}/run", "--out", "{t}/out"),
         ("run/trainable.safetensors", "copy it again"),
         {"run": run_folder({"run_dir": "{t}/run"}, weights=b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")}),
    Case("checkpoint-other-run", "checkpoint", "run_dir holding a run with another config (optim.lr)",
         SFT + ("model.preset=null", "model.path={hf}"),
         ("run/config.yaml: run_dir holds a run with a different config (sections ['optim'])",
          "checkpoint.resume=false"),
         {"run": run_folder({"run_dir": "{t}/run", "optim": {"lr": 0.5}})}),
    Case("checkpoint-report-no-metrics", "checkpoint", "`posttrain report` of a folder without metrics",
         ("report", "{t}/run"), ("run/metrics.jsonl: no such metrics file", "pass a run folder"),
         {"run/notes.txt": "not a run\n"}),
    # --- issue #34: encodings, outputs that cannot be written, a config key given twice, unsafe paths
    Case("config-duplicate-key", "config", "top-level key given twice in the YAML file (train:)",
         ("sft", "--config", "{t}/bad.yaml", RUN),
         (f"bad.yaml:{SFT_TINY.count(chr(10)) + 1}: duplicate key 'train' (first set on line {TRAIN_LINE})",
          "delete one of them"),
         {"bad.yaml": SFT_TINY + "train:\n  steps: 3\n"}),
    Case("config-run-dir-is-a-file", "config", "run_dir naming an existing file",
         SFT, ("run_dir {t}/run is an existing file, not a folder", "set run_dir to a folder you can write"),
         {"run": "my notes, not a run folder\n"}),
    Case("config-run-dir-under-a-file", "config", "run_dir that cannot be created (a file on its path)",
         SFT + ("run_dir={t}/notes.txt/run",),
         ("run_dir {t}/notes.txt/run cannot be created: {t}/notes.txt is a file",),
         {"notes.txt": "my notes\n"}),
    Case("config-run-dir-no-permission", "config", "run_dir in a folder nobody may create entries in (/sys)",
         SFT + ("run_dir=/sys/posttrain-run",), ("run_dir /sys/posttrain-run cannot be created in /sys",)),
    Case("config-prometheus-port-in-use", "config", "Prometheus exporter on a port another process listens on",
         ("sft", "--config", "{t}/bad.yaml", RUN),
         ("the Prometheus exporter cannot listen there", "the port is in use", "metrics.prometheus_port"),
         {"bad.yaml": config_with_busy_port}),
    Case("config-prometheus-bad-host", "config", "Prometheus host that is not an address of this machine",
         SFT + ("metrics.sinks=[jsonl,prometheus]", "metrics.prometheus_host=192.0.2.1", "metrics.prometheus_port=0"),
         ("metrics.prometheus_host='192.0.2.1'", "the host is not an address of this machine")),
    Case("data-utf16", "data", "JSONL file saved as UTF-16 (with its byte-order mark)",
         SFT + ("data.train={t}/rows.jsonl",), ("rows.jsonl:1: the file is UTF-16-encoded", "re-save", "as UTF-8"),
         {"rows.jsonl": encoded('{"prompt": "1+1=", "completion": "2"}\n', "utf-16")}),
    Case("data-latin1", "data", "JSONL file whose 2nd line is Latin-1, not UTF-8",
         SFT + ("data.train={t}/rows.jsonl",), ("rows.jsonl:2: byte 16 of the line is not UTF-8", "as UTF-8"),
         {"rows.jsonl": encoded('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "caf\u00e9", '
                                '"completion": "x"}\n', "latin-1")}),
    Case("model-index-parent-path", "model", "model.safetensors.index.json naming a shard in ../",
         SFT + HF, ("model.safetensors.index.json: the shard of tensor 'model.embed_tokens.weight' is "
                    "'../outside.safetensors', which is not a file inside the model folder",),
         {"model": index_folder("../outside.safetensors"), "outside.safetensors": "not read\n"}),
    Case("model-index-absolute-path", "model", "model.safetensors.index.json naming a shard by absolute path",
         SFT + HF, ("the shard of tensor 'model.embed_tokens.weight' is '/etc/hostname', which is not a file "
                    "inside the model folder",), {"model": index_folder("/etc/hostname")}),
    Case("model-generate-bad-dtype", "model", "`posttrain generate --dtype bfloat`",
         ("generate", "--model", "{hf}", "--prompt", "hi", "--dtype", "bfloat"),
         ("--dtype 'bfloat' is not a supported weights dtype", "bfloat16 (bf16)", "float16 (fp16, half, f16)")),
    Case("checkpoint-export-bad-dtype", "checkpoint", "`posttrain export --dtype fp17`",
         ("export", "--run", "{t}/run", "--out", "{t}/out", "--dtype", "fp17"),
         ("--dtype 'fp17' is not a supported weights dtype", "float32 (fp32, float, f32)"),
         {"run": run_folder({"run_dir": "{t}/run"}, weights=b"not read")}),
    Case("checkpoint-export-into-run", "checkpoint", "`posttrain export --out` naming the run folder itself",
         ("export", "--run", "{t}/run", "--out", "{t}/run"),
         ("--out {t}/run is the run folder; exporting there would replace the run", "choose another --out"),
         {"run": run_folder({"run_dir": "{t}/run"}, weights=b"weights")}),
    Case("checkpoint-export-into-checkpoints", "checkpoint", "`posttrain export --out` inside the run's checkpoints/",
         ("export", "--run", "{t}/run", "--out", "{t}/run/checkpoints/hf"),
         ("is inside the files of the run folder {t}/run",),
         {"run": run_folder({"run_dir": "{t}/run"}, weights=b"weights"), "run/checkpoints/2/x": "a checkpoint\n"}),
    Case("checkpoint-export-over-user-files", "checkpoint", "`posttrain export --out` a folder with the user's files",
         ("export", "--run", "{t}/run", "--out", "{t}/out"),
         ("--out {t}/out already holds files that posttrain export did not write ('notes.txt')", "--overwrite"),
         {"run": run_folder({"run_dir": "{t}/run"}, weights=b"weights"), "out/notes.txt": "mine\n"}),
]
