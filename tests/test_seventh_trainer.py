"""Adding a trainer touches only its own module (and its config and docs): a recipe module dropped into the
trainers package is found by the registry, runs from the command line on the shared driver, names itself in
run.json and exports like the others."""

import json
import os

from posttrain import cli
from posttrain import trainers as T

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODULE = '''"""A seventh recipe for the test: SFT with its own name and section."""

import dataclasses

from flax import nnx

from posttrain import config as C
from posttrain.data import batches, load_examples
from posttrain.losses import sft_loss
from posttrain.plan import flops_per_token
from posttrain.recipes.build import build_model
from posttrain.recipes.recipe import Parts, Recipe


@dataclasses.dataclass(frozen=True, kw_only=True)
class MineSection(C.Section):
    key = "mine"

    scale: C.Positive = 1.0  # the loss is multiplied by this


@dataclasses.dataclass(frozen=True, kw_only=True)
class MineConfig(C.RunConfig):
    mine: MineSection = dataclasses.field(default_factory=MineSection)  # this recipe's own settings
    run_dir: str = "runs/mine"  # folder for checkpoints, logs and the saved config


class MineTrainer(Recipe):
    name = "mine"
    help = "a seventh trainer"
    config_class = MineConfig

    def load(self):
        c = self.config
        self.examples, _ = load_examples(c.data.train, self.tokenizer, max_length=c.data.max_length)
        self.model = build_model(c.model, self.tokenizer, c.lora, self.mesh, self.rules)

    def build(self) -> Parts:
        c, scale = self.config, self.config.mine.scale

        def loss(model, batch, **kw):
            total, metrics = sft_loss(model, batch, **kw)
            return scale * total, metrics

        return Parts(model=self.model, loss_fn=loss, trainable=nnx.Param, summary=f"{len(self.examples)} examples",
                     batches=lambda graphdef: iter(batches(self.examples, batch_size=c.train.batch_size,
                                                           seq_len=c.data.max_length, pad_id=self.tokenizer.pad_id,
                                                           packing=False, seed=0)),
                     flops_per_token=flops_per_token(self.model.cfg, c.data.max_length))


RECIPE = MineTrainer
'''


def test_a_seventh_trainer_is_one_module(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "mine.py").write_text(MODULE)
    monkeypatch.setattr(T, "__path__", [*T.__path__, str(folder)])  # as if the file were in posttrain/trainers/
    monkeypatch.setattr(T, "TRAINERS", T.scan())
    assert T.TRAINERS["mine"] == ("mine", "a seventh trainer") and list(T.TRAINERS)[:len(T.ORDER)] == list(T.ORDER)
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(f"model: {{preset: demo-tiny}}\ndata: {{train: {REPO}/tests/data/sft_prompt_completion.jsonl, "
                   f"max_length: 64}}\nmine: {{scale: 2.0}}\ntrain: {{steps: 2, batch_size: 2}}\n"
                   f"optim: {{lr: 1.0e-3}}\nrun_dir: {tmp_path}/run\n")
    assert cli.main(["mine", "--config", str(cfg)]) == 0
    assert "[mine] done: loss" in capsys.readouterr().out
    assert json.load(open(tmp_path / "run" / "run.json")) == {"recipe": "mine"}
    assert cli.main(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert os.path.isfile(tmp_path / "hf" / "config.json")
