"""`posttrain schema`: the JSON Schemas accept every shipped config and reject what `config.load` rejects."""

import glob
import json
import os

import jsonschema
import pytest
import yaml

from posttrain import cli
from posttrain.runs import config_recipe


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    out = tmp_path_factory.mktemp("schemas")
    assert cli.main(["schema", "--out", str(out)]) == 0
    return {os.path.basename(p).split(".")[0]: json.load(open(p)) for p in glob.glob(f"{out}/*.schema.json")}


def test_every_shipped_config_validates(schemas):
    assert set(schemas) == {"sft", "dpo", "kto", "rm", "grpo", "ppo", "online_dpo", "distill", "pipeline"}
    files = sorted(glob.glob("configs/*.yaml") + glob.glob("configs/*/*.yaml"))  # configs/real/ too
    assert len(files) >= 10 and "configs/real/smollm2_grpo.yaml" in files
    for path in files:
        data = yaml.safe_load(open(path))
        name = "pipeline" if "stages" in data else config_recipe(path)
        jsonschema.validate(data, schemas[name])  # raises on any mismatch


@pytest.mark.parametrize("change,what", [
    (lambda d: d["optim"].update(lr_="x"), "Additional properties"),  # a typo'd key
    (lambda d: d["data"].update(truncation="cut"), "is not one of"),  # not a Literal choice
    (lambda d: d["train"].update(steps="many"), "is not of type 'integer'"),
    (lambda d: d["data"].pop("train"), "'train' is a required property"),
])
def test_the_schema_rejects_what_the_loader_rejects(schemas, tmp_path, change, what):
    data = yaml.safe_load(open("configs/sft_tiny.yaml"))
    change(data)
    with pytest.raises(jsonschema.ValidationError, match=what):
        jsonschema.validate(data, schemas["sft"])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    assert cli.main(["sft", "--config", str(path)]) == 2  # and posttrain itself refuses it too


def test_pipeline_schema_checks_each_stage_with_its_trainer(schemas):
    good = {"model": "demo-tiny", "stages": [{"recipe": "sft", "data": {"train": "a.jsonl"}},
                                             {"recipe": "grpo", "grpo": {"num_generations": 4}}]}
    jsonschema.validate(good, schemas["pipeline"])
    bad = {"model": "demo-tiny", "stages": [{"recipe": "sft", "grpo": {"num_generations": 4}}]}  # not an SFT key
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schemas["pipeline"])
    assert schemas["grpo"]["properties"]["grpo"]["properties"]["num_generations"]["description"]  # from the source


def _properties(schema, where=""):
    """(dotted key, property schema) of every key, nested sections included."""
    for name, prop in schema.get("properties", {}).items():
        yield f"{where}{name}", prop
        for option in [prop, *prop.get("anyOf", [])]:
            if option.get("type") == "object" and "properties" in option:
                yield from _properties(option, f"{where}{name}.")


@pytest.mark.parametrize("name", ["sft", "dpo", "rm", "grpo", "ppo", "distill"])
def test_every_key_has_a_description(schemas, name):
    keys = list(_properties(schemas[name]))
    assert len(keys) > 40
    assert [k for k, p in keys if not p.get("description")] == []


def test_schema_shows_the_bounds(schemas):
    props = dict(_properties(schemas["grpo"]))
    assert props["optim.lr"]["exclusiveMinimum"] == 0
    assert props["train.steps"]["minimum"] == 1
    assert props["grpo.num_generations"]["minimum"] == 2
    assert props["optim.beta2"]["minimum"] == 0 and props["optim.beta2"]["exclusiveMaximum"] == 1
    assert props["lora.dropout"]["exclusiveMaximum"] == 1
    micro = props["train.micro_batch_size"]["anyOf"]  # Optional: the bound on the number branch
    assert {"minimum": 1, "type": "integer"} in micro


@pytest.mark.parametrize("override,message", [
    ("optim.lr=0", "optim.lr must be > 0, got 0"),
    ("optim.beta2=1.0", "optim.beta2 must be in [0, 1), got 1.0"),
    ("train.micro_batch_size=0", "train.micro_batch_size must be >= 1 or null, got 0"),
    ("grpo.num_generations=1", "grpo.num_generations must be >= 2, got 1"),
])
def test_a_value_out_of_bounds_names_the_key_and_the_bound(override, message):
    from posttrain import config as C
    from posttrain.errors import PosttrainError
    from posttrain.trainers.grpo import GRPOConfig

    with pytest.raises(PosttrainError) as err:
        C.load(GRPOConfig, None, ["model.preset=tiny", "data.train=t.jsonl", override])
    assert str(err.value) == f"command line: {message}"
