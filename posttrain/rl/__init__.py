"""RL data flow: prompts -> samples from the train state's weights -> rewards -> advantages -> rows."""

from posttrain.rl.rollout import GroupRollout

__all__ = ["GroupRollout"]
