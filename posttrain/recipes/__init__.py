"""The recipe driver: what turns a trainer module into a training run, above the engine (`posttrain.train`).

  recipe.py     the Recipe protocol (`load`, `build -> Parts`, `done_line`, ...) and its driver (`setup`,
                `train`): the train state, the jitted step, the batch source, the evaluation hook
  build.py      what every recipe builds the same way: tokenizer, device mesh, model, memory plan
  lifecycle.py  the run folder (checks, config comparison, lock, run.json) and `run_trainer` (the engine's
                Trainer with the recipe's hooks, then the run report)
  rl.py         RLRecipe: the opening every sampling recipe shares (prompts, rewards, policy, sampler on
                rollout.devices in rollout.dtype, sampling params) and the rollout options its loss takes

The recipes themselves are `posttrain.trainers` (one module each). Nothing in `posttrain.train` imports this
package (tests/test_imports.py).
"""

from posttrain.recipes.recipe import Parts, Recipe, Setup, group_rows, lora_reference
from posttrain.recipes.rl import RLRecipe

__all__ = ["Parts", "Recipe", "RLRecipe", "Setup", "group_rows", "lora_reference"]
