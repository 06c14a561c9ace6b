"""The names the algorithm code accepts, derived from the spec's literals: the spec is the one
place a recipe, an importance-sampling mode or a loss aggregation is spelled, so a name added
there is accepted everywhere and a name removed is refused everywhere."""

from __future__ import annotations

from typing import get_args

from rljob.spec import Aggregation, IsMode, Recipe

RECIPES: tuple[Recipe, ...] = get_args(Recipe)
IS_MODES: tuple[IsMode, ...] = get_args(IsMode)
AGGREGATIONS: tuple[Aggregation, ...] = get_args(Aggregation)
