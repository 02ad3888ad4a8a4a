"""Training engine: train state, the jitted step, the optax chain and the one training loop."""

from posttrain.train.loop import train_loop
from posttrain.train.optim import decay_mask, make_optimizer, schedule
from posttrain.train.step import TrainState, init_state, make_train_step, merge

__all__ = ["train_loop", "decay_mask", "make_optimizer", "schedule", "TrainState", "init_state",
           "make_train_step", "merge"]
