"""Config loading: YAML + dotted overrides -> frozen dataclasses, with errors that name the key."""

import dataclasses
import json
import textwrap
from typing import Literal

import pytest

from posttrain.config import (
    DataSection,
    LoraSection,
    ModelSection,
    OptimSection,
    SFTConfig,
    TrainSection,
    from_dict,
    load,
    save,
    to_dict,
)
from posttrain.errors import PosttrainError

MINIMAL = {"model": {"preset": "tiny"}, "data": {"train": "train.jsonl"}}


def write(tmp_path, text, name="config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def raises(match_parts, fn, *args, **kwargs):
    """Call fn, expect PosttrainError, and check each fragment appears in the message."""
    with pytest.raises(PosttrainError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match_parts:
        assert part in msg, f"{part!r} not in {msg!r}"
    return msg


def test_yaml_nested_sections_and_defaults(tmp_path):
    path = write(tmp_path, """
        model: {path: /ckpt/llama, compute_dtype: bfloat16, remat: true}
        data:
          train: data/train.jsonl
          truncation: keep_end
          packing: true
        optim: {lr: 2.0e-5, schedule: linear, warmup_steps: 10, max_grad_norm: null}
        lora: {enabled: true, rank: 4, targets: [qkv, o]}
        train: {steps: 50, batch_size: 16, micro_batch_size: 4}
        run_dir: runs/x
    """)
    cfg = load(SFTConfig, path)
    assert cfg.model == ModelSection(path="/ckpt/llama", compute_dtype="bfloat16", remat=True)
    assert cfg.data.truncation == "keep_end" and cfg.data.packing is True
    assert cfg.data.max_length == 512  # untouched fields keep their defaults
    assert cfg.optim.lr == 2e-5 and cfg.optim.schedule == "linear" and cfg.optim.max_grad_norm is None
    assert cfg.optim.beta2 == 0.999
    assert cfg.lora.targets == ("qkv", "o") and isinstance(cfg.lora.targets, tuple)
    assert cfg.train == TrainSection(steps=50, batch_size=16, micro_batch_size=4)
    assert cfg.run_dir == "runs/x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run_dir = "elsewhere"


def test_yaml_1_1_exponent_floats_are_numbers(tmp_path):
    # PyYAML reads `3e-4` (no dot) as the string "3e-4"; float fields must still get 0.0003.
    import yaml

    assert yaml.safe_load("3e-4") == "3e-4"
    path = write(tmp_path, """
        model: {preset: tiny}
        data: {train: t.jsonl}
        optim: {lr: 3e-4, eps: 1e-6}
        lora: {alpha: 32}
    """)
    cfg = load(SFTConfig, path)
    assert cfg.optim.lr == 0.0003 and type(cfg.optim.lr) is float
    assert cfg.optim.eps == 1e-6
    assert cfg.lora.alpha == 32.0 and type(cfg.lora.alpha) is float  # int accepted for float


def test_overrides_change_values_and_types(tmp_path):
    path = write(tmp_path, "model: {preset: tiny}\ndata: {train: t.jsonl}\noptim: {lr: 1.0e-5}\n")
    cfg = load(SFTConfig, path, ["optim.lr=3e-4", "lora.targets=[qkv,o]", "train.steps=10",
                                 "lora.enabled=true", "train.micro_batch_size=2", "data.eval=e.jsonl"])
    assert cfg.optim.lr == 0.0003 and type(cfg.optim.lr) is float
    assert cfg.lora.targets == ("qkv", "o")
    assert cfg.train.steps == 10 and type(cfg.train.steps) is int
    assert cfg.lora.enabled is True and cfg.train.micro_batch_size == 2 and cfg.data.eval == "e.jsonl"
    # null resets an Optional; the last override of a key wins; overrides alone (no file) work too.
    cfg = load(SFTConfig, None, ["model.preset=tiny", "data.train=t.jsonl", "optim.max_grad_norm=null",
                                 "train.steps=3", "train.steps=4"])
    assert cfg.optim.max_grad_norm is None and cfg.train.steps == 4


def test_unknown_key_in_yaml_names_dotted_key_and_suggests(tmp_path):
    path = write(tmp_path, "model: {preset: tiny}\ndata: {train: t.jsonl}\noptim: {lrr: 1.0e-5}\n")
    msg = raises(["config.yaml", "unknown key 'optim.lrr'", "known keys under optim:", "did you mean 'lr'?"],
                 load, SFTConfig, path)
    assert "beta1" in msg  # lists the known keys
    raises(["unknown key 'trian'", "did you mean 'train'?"], from_dict, SFTConfig, {**MINIMAL, "trian": {}})


def test_unknown_key_in_override():
    raises(["command line", "unknown key 'optim.lrr'", "did you mean 'lr'?"],
           load, SFTConfig, None, ["model.preset=tiny", "data.train=t", "optim.lrr=1e-5"])
    raises(["command line", "unknown key 'optimm'", "did you mean 'optim'?"],
           load, SFTConfig, None, ["optimm.lr=1e-5"])
    raises(["'optim.lr' is a value, not a section"], load, SFTConfig, None, ["optim.lr.x=1"])


def test_wrong_type_names_key_expected_type_and_value():
    raises(["config", "'train.steps'", "must be int", "'ten'"],
           from_dict, SFTConfig, {**MINIMAL, "train": {"steps": "ten"}})
    raises(["'train.steps'", "must be int", "2.5"],
           from_dict, SFTConfig, {**MINIMAL, "train": {"steps": 2.5}})
    raises(["'optim.lr'", "must be float", "'fast'"],
           from_dict, SFTConfig, {**MINIMAL, "optim": {"lr": "fast"}})
    raises(["'data.train'", "must be str", "quote it"], from_dict, SFTConfig,
           {"model": {"preset": "tiny"}, "data": {"train": 5}})
    raises(["'lora.targets'", "list of str"], from_dict, SFTConfig, {**MINIMAL, "lora": {"targets": "qkv"}})
    raises(["'lora.targets[1]'", "must be str"],
           from_dict, SFTConfig, {**MINIMAL, "lora": {"targets": ["a", 1]}})
    raises(["'optim'", "must be a mapping"], from_dict, SFTConfig, {**MINIMAL, "optim": 3})
    # A bad override value is blamed on the command line.
    raises(["command line", "'train.batch_size'", "must be int"],
           load, SFTConfig, None, ["train.batch_size=big"])


def test_bool_must_be_a_real_bool():
    for bad in ("true", "yes", 1, 0):
        raises(["'lora.enabled'", "must be bool", "true or false"],
               from_dict, SFTConfig, {**MINIMAL, "lora": {"enabled": bad}})
    # Conversely a bool is not a number (bool is an int subclass in Python).
    raises(["'train.steps'", "must be int"], from_dict, SFTConfig, {**MINIMAL, "train": {"steps": True}})
    raises(["'lora.enabled'", "must be bool"], load, SFTConfig, None, ["lora.enabled='true'"])


def test_literal_violation_lists_allowed_values():
    raises(["'data.truncation'", "'error', 'keep_start', 'keep_end', 'drop'", "'cut'"],
           from_dict, SFTConfig, {"model": {"preset": "tiny"}, "data": {"train": "t", "truncation": "cut"}})
    raises(["'optim.schedule'", "'constant', 'linear', 'cosine'"],
           load, SFTConfig, None, ["optim.schedule=exp"])
    raises(["'metrics.sinks[1]'", "'console', 'jsonl', 'tensorboard', 'prometheus', 'wandb'", "'mlflow'"],
           load, SFTConfig, None, ["model.preset=tiny", "data.train=t", "metrics.sinks=[jsonl, mlflow]"])


def test_missing_required_field_is_named():
    raises(["missing required key 'data.train'"], from_dict, SFTConfig, {"model": {"preset": "tiny"}})
    raises(["missing required key 'data.train'", "data.train=..."],
           from_dict, SFTConfig, {"model": {"preset": "tiny"}, "data": {"eval": "e"}})


def test_override_without_equals_shows_expected_form():
    raises(["'optim.lr'", "key=value"], load, SFTConfig, None, ["optim.lr"])


def test_missing_yaml_file_names_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    raises([missing], load, SFTConfig, missing)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model: {preset: tiny}\ndata:\n  train: t.jsonl\n   bad: [unclosed\n")
    raises([f"{path}:4", "YAML syntax error"], load, SFTConfig, path)


def test_non_mapping_yaml_and_empty_file(tmp_path):
    raises(["top level must be a mapping"], load, SFTConfig, write(tmp_path, "- a\n- b\n"))
    # An empty file is an empty config; the required keys can then come from the command line.
    cfg = load(SFTConfig, write(tmp_path, ""), ["model.preset=tiny", "data.train=t"])
    assert cfg.data.train == "t"


def test_invariants():
    raises(["exactly one of model.path", "model.preset", "both"],
           from_dict, SFTConfig, {"model": {"path": "/p", "preset": "tiny"}, "data": {"train": "t"}})
    raises(["exactly one of", "neither"], ModelSection)
    msg = raises(["config.yaml", "train.micro_batch_size (3) must divide train.batch_size (8)"],
                 from_dict, SFTConfig, {**MINIMAL, "train": {"batch_size": 8, "micro_batch_size": 3}},
                 "config.yaml")
    assert msg.startswith("config.yaml: ")
    raises(["optim.lr must be > 0"], OptimSection, lr=0.0)
    raises(["optim.beta2 must be in [0, 1)"], OptimSection, beta2=1.0)
    raises(["optim.warmup_steps must be >= 0"], OptimSection, warmup_steps=-1)
    raises(["lora.rank must be >= 1"], LoraSection, rank=0)
    raises(["lora.dropout must be in [0, 1)"], LoraSection, dropout=1.0)
    raises(["train.steps must be >= 1"], TrainSection, steps=0)
    assert TrainSection(batch_size=8, micro_batch_size=4).micro_batch_size == 4


def test_round_trip_to_dict_from_dict_and_save_load(tmp_path):
    cfg = load(SFTConfig, None, ["model.path=/ckpt", "model.compute_dtype=bfloat16", "data.train=t.jsonl",
                                 "data.eval=e.jsonl", "optim.lr=3e-4", "lora.enabled=true",
                                 "lora.targets=[qkv]", "train.micro_batch_size=4"])
    d = to_dict(cfg)
    assert d["lora"]["targets"] == ["qkv"]  # tuples become lists
    assert json.loads(json.dumps(d)) == d  # JSON serialisable
    assert from_dict(SFTConfig, d) == cfg
    save(cfg, tmp_path / "run" / "config.yaml")
    assert load(SFTConfig, str(tmp_path / "run" / "config.yaml")) == cfg
    assert to_dict(from_dict(SFTConfig, MINIMAL)) == to_dict(SFTConfig(model=ModelSection(preset="tiny"),
                                                                      data=DataSection(train="train.jsonl")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Inner:
    ids: tuple[int, ...] = (1, 2)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Outer:
    mode: Literal["a", "b"] = "a"
    limit: int | None = None
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_generic_types_tuple_int_dict_and_optional():
    out = load(_Outer, None, ["inner.ids=[3, 4, 5]", "inner.weights.kl=0.1", "inner.weights.sft=1",
                              "limit=7"])
    assert out == _Outer(limit=7, inner=_Inner(ids=(3, 4, 5), weights={"kl": 0.1, "sft": 1.0}))
    assert from_dict(_Outer, to_dict(out)) == out
    assert from_dict(_Outer, {"inner": None}) == _Outer()  # an empty YAML section means defaults
    raises(["'inner.ids[0]'", "must be int"], from_dict, _Outer, {"inner": {"ids": ["x"]}})
    raises(["'inner.weights.kl'", "must be float"], from_dict, _Outer, {"inner": {"weights": {"kl": "big"}}})
    raises(["'limit'", "must be int", "'many'"], from_dict, _Outer, {"limit": "many"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Maps:
    layers: dict[int, int] = dataclasses.field(default_factory=dict)


def test_strict_types_and_the_yaml_habits_that_are_eased():
    # Strict: no text for a number, no float for an int (even 10.0), no bool for a float.
    raises(["'train.steps'", "must be int", "'10'"], from_dict, SFTConfig, {**MINIMAL, "train": {"steps": "10"}})
    raises(["'train.steps'", "must be int", "10.0"], from_dict, SFTConfig, {**MINIMAL, "train": {"steps": 10.0}})
    raises(["'optim.lr'", "must be float", "True"], from_dict, SFTConfig, {**MINIMAL, "optim": {"lr": True}})
    # Eased: YAML 1.1 exponent strings for floats (Optional ones too), an empty section, a ready section.
    cfg = from_dict(SFTConfig, {**MINIMAL, "optim": {"lr": "1e-4", "max_grad_norm": "5e-1"}, "lora": None,
                                "train": TrainSection(steps=3)})
    assert cfg.optim.lr == 1e-4 and cfg.optim.max_grad_norm == 0.5 and type(cfg.optim.max_grad_norm) is float
    assert cfg.lora == LoraSection() and cfg.train == TrainSection(steps=3)
    # An unknown key is reported before a missing one (the typo is the likelier cause).
    raises(["unknown key 'data.trian'", "did you mean 'train'?"],
           from_dict, SFTConfig, {"model": {"preset": "tiny"}, "data": {"trian": "t.jsonl"}})
    # int-keyed maps (YAML `0: 3`) keep int keys; a key of another type blames the mapping.
    assert from_dict(_Maps, {"layers": {0: 3, 1: 5}}).layers == {0: 3, 1: 5}
    raises(["'layers' must be a mapping of int to int", "{'a': 1}"], from_dict, _Maps, {"layers": {"a": 1}})
    raises(["the top level must be a mapping of keys (layers)", "[1]"], from_dict, _Maps, [1])


def test_renamed_keys_are_read_by_their_old_names_with_a_warning(tmp_path):
    """ppo.kl_coef and ppo.ppo_epochs are now ppo.beta and ppo.num_iterations (GRPO's names for the KL weight
    and the passes over a rollout): the old names still load, for one release, with a FutureWarning."""
    from posttrain.trainers.ppo import PPOConfig

    path = write(tmp_path, "model: {preset: tiny}\ndata: {train: t.jsonl}\nppo: {kl_coef: 0.2, ppo_epochs: 3}\n")
    with pytest.warns(FutureWarning, match=r"'ppo.kl_coef' is now called 'beta'"):
        cfg = load(PPOConfig, path)
    assert (cfg.ppo.beta, cfg.ppo.num_iterations) == (0.2, 3)
    with pytest.warns(FutureWarning, match="'ppo.ppo_epochs' is now called 'num_iterations'"):
        cfg = load(PPOConfig, None, ["model.preset=tiny", "data.train=t", "ppo.ppo_epochs=4"])
    assert cfg.ppo.num_iterations == 4
    both = write(tmp_path, "model: {preset: tiny}\ndata: {train: t.jsonl}\nppo: {kl_coef: 0.2, beta: 0.1}\n")
    raises(["'ppo.kl_coef' is the old name of 'beta', which is set too"], load, PPOConfig, both)
