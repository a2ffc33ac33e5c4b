"""Run composition: a whole run's config (PretrainConfig), build() that turns it into a Trainer, and
named recipes (functions returning a full PretrainConfig with the world size they are laid out for).

This is the layer above core, models, parallel and data (which never import it); tools/pretrain.py,
benchmarks, examples and tests compose runs from here.

    from moetron.run import build, recipe
    cfg = recipe("tiny-moe-local")
    trainer, state = build(cfg, torch.device("cpu"), world=1)
"""

from .build import build, seed_everything
from .config import PretrainConfig, check_layout
from .recipes import RECIPES, Recipe, recipe

__all__ = ["RECIPES", "PretrainConfig", "Recipe", "build", "check_layout", "recipe", "seed_everything"]
