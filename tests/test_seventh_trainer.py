"""Adding a trainer touches only its own module (and its config and docs): a recipe module dropped into the
trainers package is found by the registry, runs from the command line on the shared driver, names itself in
run.json and exports like the others. An eighth, an RL recipe on `recipes.rl.RLRecipe`, is one module too: its
section, its loss and its build; prompts, rewards, sampler and the sampler's own devices (rollout.devices) are
the base's."""

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


RL_MODULE = '''"""An eighth recipe for the test: REINFORCE++ advantages (by name), LUSPO's loss, on the RL base."""

import dataclasses

from flax import nnx

from posttrain import config as C
from posttrain.losses.grpo import make_grpo_loss
from posttrain.plan import flops_per_token
from posttrain.recipes import Parts
from posttrain.recipes.rl import RLRecipe
from posttrain.rl.rollout import GroupRollout


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReinforceSection(C.Sampling, C.Rewards):
    key = "reinforce"

    num_generations: C.AtLeast1 = 4  # samples per prompt


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReinforceConfig(C.RunConfig):
    model: C.ModelSection  # the policy (required)
    data: C.PromptDataSection  # prompts (required)
    reinforce: ReinforceSection = dataclasses.field(default_factory=ReinforceSection)  # sampling, rewards
    rollout: C.RolloutSection = dataclasses.field(default_factory=C.RolloutSection)  # the sampler's devices
    run_dir: str = "runs/reinforce"  # folder for checkpoints, logs and the saved config


class ReinforceTrainer(RLRecipe):
    name = "reinforce"
    help = "an eighth trainer"
    config_class = ReinforceConfig

    def make_loss(self):
        s = self.section
        return make_grpo_loss(num_generations=s.num_generations, max_new_tokens=self.width,
                              temperature=s.temperature, loss_type="luspo")

    def build(self) -> Parts:
        n = self.section.num_generations
        rollout = lambda graphdef: GroupRollout(  # noqa: E731
            self.prompts, self.tokenizer, self.make_sampler(), graphdef, n=n, params=self.sampling_params(),
            advantages="reinforce_pp", **self.rollout_kwargs())
        return Parts(model=self.model, loss_fn=self.loss_fn, trainable=nnx.Param, batches=rollout,
                     summary=f"{len(self.prompts)} prompts",
                     flops_per_token=flops_per_token(self.model.cfg, self.length))

    @staticmethod
    def done_line(r: dict) -> str:
        return f"{r['step']} steps, reward {r.get('reward/mean', float('nan')):.3f}"


RECIPE = ReinforceTrainer
'''


def test_an_eighth_rl_recipe_is_one_module_on_the_rl_base(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "reinforce.py").write_text(RL_MODULE)
    monkeypatch.setattr(T, "__path__", [*T.__path__, str(folder)])
    monkeypatch.setattr(T, "TRAINERS", T.scan())
    assert T.TRAINERS["reinforce"] == ("reinforce", "an eighth trainer")
    cfg = tmp_path / "reinforce.yaml"
    cfg.write_text(f"model: {{preset: demo-tiny}}\ndata: {{train: {REPO}/tests/data/grpo_addition.jsonl, "
                   f"max_prompt_length: 8}}\nreinforce: {{num_generations: 4, max_new_tokens: 4}}\n"
                   f"train: {{steps: 2, batch_size: 2}}\nsharding: {{preset: dp, mesh_shape: {{data: 2}}}}\n"
                   f"rollout: {{devices: 2}}\noptim: {{lr: 1.0e-3}}\nrun_dir: {tmp_path}/run\n")
    assert cli.main(["reinforce", "--config", str(cfg)]) == 0
    assert "[reinforce] done: 2 steps, reward" in capsys.readouterr().out
    assert json.load(open(tmp_path / "run" / "run.json")) == {"recipe": "reinforce"}
    cfg.write_text(cfg.read_text().replace("rollout: {devices: 2}", "rollout: {is_mode: token_mask}"))
    assert cli.main(["reinforce", "--config", str(cfg)]) == 2  # the loss given takes no sampler correction
    assert "rollout.is_mode is not supported by reinforce" in capsys.readouterr().err
