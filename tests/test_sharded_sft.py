"""The SFT trainer under every mesh preset on 8 CPU devices equals the single-device run."""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from posttrain import config as C
from posttrain.trainers.sft import SFTTrainer

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "sft_prompt_completion.jsonl")


def _train(run_dir, *extra):
    # eps 1e-5: Adam's update of near-zero gradients is sign-like, so with the default 1e-8 the
    # reduction order of sharded sums (not a bug) moves a few parameters by ~1e-5 (see test_sharding).
    cfg = C.load(C.SFTConfig, None, ["model.preset=demo-tiny", f"data.train={DATA}", "data.max_length=32",
                                     "train.steps=3", "train.batch_size=8", "train.log_every=1", "optim.eps=1e-5",
                                     "optim.lr=1e-3", "metrics.sinks=[jsonl]", f"run_dir={run_dir}", *extra])
    trainer = SFTTrainer(cfg, progress=False)
    result = trainer.train()
    return result, load_file(os.path.join(run_dir, "trainable.safetensors")), trainer


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _train(str(tmp_path_factory.mktemp("single") / "run"))


# fsdp_tp here and dp in test_dpo.py cover the three mesh axes through the shared trainer
# lifecycle; every preset is checked at the train-step level in test_sharding.py, this test
# checks the trainer's wiring (mesh, state and batch placement).
@pytest.mark.parametrize("preset", ["fsdp_tp"])
def test_sharded_sft_matches_one_device(single, tmp_path, preset):
    assert jax.device_count() == 8
    ref_result, ref_w, _ = single
    result, w, trainer = _train(str(tmp_path / "run"), f"sharding.preset={preset}")
    assert trainer.mesh.devices.size == 8
    assert abs(result["loss"] - ref_result["loss"]) <= 1e-5
    assert max(float(np.abs(w[k] - ref_w[k]).max()) for k in ref_w) <= 1e-5
    if preset == "fsdp_tp":  # the MLP's F axis of gate_up [D, 2, F] is split over `tensor`
        spec = tuple(trainer.model.layers[0].mlp.gate_up[...].sharding.spec) + (None,) * 3
        assert spec[2] == "tensor"
