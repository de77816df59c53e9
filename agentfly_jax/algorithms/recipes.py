"""Algorithm recipes: a name (`config.algorithm`) -> everything the trainer needs to run that algorithm.

A recipe names its advantage estimator and policy loss (both from the registries), its loss aggregation,
whether it trains a critic, and which knobs of the `advantage` and `loss` config sections it takes, with
their defaults. The trainer only looks a recipe up (`get_recipe`) and asks it to `resolve` the config's
knobs; a knob the recipe would ignore is refused, naming the key. Adding an algorithm is one registered
`Recipe` plus its reference test.

Two KL knobs, named for where they act:
- `advantage.kl_in_reward_coef`: -coef * KL(policy || reference) per token is added to the reward before
  the advantage is estimated (REINFORCE++, PPO); only estimators that take per-token rewards accept it.
- `loss.kl_loss_coef`: coef * KL estimate is added to the policy loss (GRPO style); any recipe.
Either one > 0 makes the trainer keep a frozen reference policy.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Mapping
from typing import Any

from agentfly_jax.algorithms.losses import AGGREGATION_MODES
from agentfly_jax.algorithms.registry import get_advantage_estimator, get_policy_loss

#: loss-section knobs every recipe takes (they act whatever the estimator).
COMMON_LOSS_KNOBS = {"clip_eps": 0.2, "clip_eps_high": None, "dual_clip": None, "kl_loss_coef": 0.0,
                     "entropy_coef": 0.0, "temperature": 1.0, "logprob_chunk": None, "is_cap": None}
KL_ESTIMATORS = ("k1", "k2", "k3")


class RecipeError(ValueError):
    """A config knob does not fit the chosen recipe; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Recipe:
    """What one algorithm is made of.

    advantage_knobs: {key of config.advantage: default} the estimator takes (passed to it by name).
    aggregation: the loss aggregation (see `algorithms.aggregation_weights`); `aggregation_fixed` means it
    defines the algorithm and `loss.aggregation` may not change it.
    kl_in_reward: the estimator takes per-token KL (so `advantage.kl_in_reward_coef` is accepted).
    loss_defaults: {loss knob: default} where the algorithm's differ from `COMMON_LOSS_KNOBS` (GSPO's small
    clip ranges).
    group_baseline: the estimator's baseline is the chain's group (GRPO, RLOO, ...): a group of one gets no
    signal, so the trainer refuses `rl.chains_per_task=1`.
    """

    name: str
    estimator: str
    policy_loss: str = "ppo"
    aggregation: str = "token-mean"
    aggregation_fixed: bool = False
    needs_critic: bool = False
    advantage_knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    kl_in_reward: bool = False
    loss_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    group_baseline: bool = False
    description: str = ""

    def __post_init__(self):
        get_advantage_estimator(self.estimator)  # both must be registered
        get_policy_loss(self.policy_loss)
        if self.aggregation not in AGGREGATION_MODES:
            raise ValueError(f"recipe {self.name!r}: aggregation {self.aggregation!r} not in {AGGREGATION_MODES}")
        params = inspect.signature(get_advantage_estimator(self.estimator)).parameters
        missing = [k for k in self.advantage_knobs if k not in params]
        if missing:
            raise ValueError(f"recipe {self.name!r}: estimator {self.estimator!r} takes no {missing}")
        # KL in the reward reaches an estimator as token_rewards (built by compute_advantages) or token_kl + kl_coef
        if self.kl_in_reward and "token_rewards" not in params and not {"token_kl", "kl_coef"} <= set(params):
            raise ValueError(f"recipe {self.name!r}: estimator {self.estimator!r} takes no per-token KL "
                             "(token_rewards, or token_kl and kl_coef)")
        unknown = [k for k in self.loss_defaults if k not in COMMON_LOSS_KNOBS]
        if unknown:
            raise ValueError(f"recipe {self.name!r}: loss_defaults {unknown} are not loss knobs "
                             f"({', '.join(COMMON_LOSS_KNOBS)})")
        loss_params = inspect.signature(get_policy_loss(self.policy_loss)).parameters
        missing = [k for k in ("clip_eps", "clip_eps_high", "dual_clip", "weights") if k not in loss_params]
        if missing:  # what the trainer's policy_loss passes to every registered loss
            raise ValueError(f"recipe {self.name!r}: policy loss {self.policy_loss!r} takes no {missing}")

    def resolve(self, advantage: Mapping[str, Any], loss: Mapping[str, Any]) -> "ResolvedAlgorithm":
        """The settings this recipe runs with, from the `advantage` and `loss` config sections (None = unset).

        Raises RecipeError naming the first key that has no effect under this recipe."""
        advantage = {k: v for k, v in advantage.items() if v is not None}
        loss = {k: v for k, v in loss.items() if v is not None}
        kl_reward = float(advantage.pop("kl_in_reward_coef", 0.0))
        kl_reward_estimator = advantage.pop("kl_in_reward_estimator", None)
        if kl_reward and not self.kl_in_reward:
            raise RecipeError(
                f"config.advantage.kl_in_reward_coef={kl_reward} has no effect under algorithm {self.name!r} "
                f"(its estimator {self.estimator!r} takes no per-token rewards); use config.loss.kl_loss_coef "
                "for a KL penalty in the loss")
        if kl_reward_estimator is not None and not kl_reward:
            raise RecipeError("config.advantage.kl_in_reward_estimator is set but "
                              "config.advantage.kl_in_reward_coef is 0: set the coefficient or unset the estimator")
        for key in advantage:
            if key not in self.advantage_knobs:
                raise RecipeError(_unused("advantage", key, self, sorted(self.advantage_knobs)
                                          + (["kl_in_reward_coef"] if self.kl_in_reward else [])))
        estimator_kwargs = {**self.advantage_knobs, **advantage}

        aggregation = loss.pop("aggregation", None)
        if aggregation is not None and aggregation != self.aggregation and self.aggregation_fixed:
            raise RecipeError(f"config.loss.aggregation={aggregation!r}: algorithm {self.name!r} is defined by "
                              f"its aggregation {self.aggregation!r}; unset it or choose another algorithm")
        aggregation = aggregation or self.aggregation
        if aggregation not in AGGREGATION_MODES:
            raise RecipeError(f"config.loss.aggregation={aggregation!r}; expected one of {AGGREGATION_MODES}")
        norm_len = loss.pop("norm_len", None)
        if norm_len is not None and aggregation != "seq-mean-token-sum-norm":
            raise RecipeError(f"config.loss.norm_len={norm_len} has no effect with aggregation {aggregation!r} "
                              "(only 'seq-mean-token-sum-norm' divides by a constant horizon)")
        kl_loss_estimator = loss.pop("kl_loss_estimator", None)
        settings = {**COMMON_LOSS_KNOBS, **self.loss_defaults}
        for key, value in loss.items():
            if key not in COMMON_LOSS_KNOBS:
                raise RecipeError(_unused("loss", key, self, sorted(COMMON_LOSS_KNOBS)
                                          + ["aggregation", "norm_len", "kl_loss_estimator"]))
            settings[key] = value
        if kl_loss_estimator is not None and not settings["kl_loss_coef"]:
            raise RecipeError("config.loss.kl_loss_estimator is set but config.loss.kl_loss_coef is 0: set the "
                              "coefficient or unset the estimator")
        for name, est in (("advantage.kl_in_reward_estimator", kl_reward_estimator),
                          ("loss.kl_loss_estimator", kl_loss_estimator)):
            if est is not None and est not in KL_ESTIMATORS:
                raise RecipeError(f"config.{name}={est!r}; expected one of {KL_ESTIMATORS}")
        return ResolvedAlgorithm(
            recipe=self, estimator_kwargs=estimator_kwargs, aggregation=aggregation, norm_len=norm_len,
            kl_in_reward_coef=kl_reward, kl_in_reward_estimator=kl_reward_estimator or "k1",
            kl_loss_estimator=kl_loss_estimator or "k3", **settings)


def _unused(section: str, key: str, recipe: Recipe, accepted: list[str]) -> str:
    close = difflib.get_close_matches(key, accepted, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"config.{section}.{key} has no effect under algorithm {recipe.name!r}{hint}; "
            f"it takes config.{section}: {', '.join(accepted) or 'nothing'}")


@dataclasses.dataclass(frozen=True)
class ResolvedAlgorithm:
    """A recipe with every knob decided: what the trainer's jitted functions close over."""

    recipe: Recipe
    estimator_kwargs: Mapping[str, Any]
    aggregation: str
    norm_len: int | None
    kl_in_reward_coef: float
    kl_in_reward_estimator: str
    kl_loss_estimator: str
    clip_eps: float
    clip_eps_high: float | None
    dual_clip: float | None
    kl_loss_coef: float
    entropy_coef: float
    temperature: float
    logprob_chunk: int | None
    is_cap: float | None
    # the update is one optimiser step on the parameters `prepare` would read (one epoch of one mini-batch) and no
    # KL enters the reward: the train step's own forward pass gives the old log-probabilities (their value, no
    # gradient), so `prepare` runs no policy forward pass of its own (config.rl.old_logprobs)
    old_logprobs_in_step: bool = False

    @property
    def needs_reference(self) -> bool:
        return bool(self.kl_in_reward_coef) or bool(self.kl_loss_coef)

    @property
    def needs_critic(self) -> bool:
        return self.recipe.needs_critic


# ------------------------------------------------------------------------------------------------ registry
_RECIPES: dict[str, Recipe] = {}


def register_recipe(recipe: Recipe) -> Recipe:
    """Registers `recipe` under its name (an error if the name is taken)."""
    if recipe.name in _RECIPES:
        raise ValueError(f"algorithm recipe {recipe.name!r} is already registered; pick another name")
    _RECIPES[recipe.name] = recipe
    return recipe


def get_recipe(name: str) -> Recipe:
    """The recipe registered as `name`; a ValueError listing the known ones (with a suggestion) otherwise."""
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, list(_RECIPES), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown algorithm {name!r}{hint}; known: {', '.join(sorted(_RECIPES))}")
    return _RECIPES[name]


def recipe_names() -> list[str]:
    return sorted(_RECIPES)


register_recipe(Recipe(
    "grpo", estimator="grpo", advantage_knobs={"normalize_std": True, "eps": 1e-6}, group_baseline=True,
    description="GRPO: group-normalised outcome advantages, PPO clipped loss, KL (if any) in the loss"))
register_recipe(Recipe(
    "drgrpo", estimator="drgrpo", aggregation="seq-mean-token-sum-norm", aggregation_fixed=True,
    group_baseline=True,
    description="Dr.GRPO: group-centred advantages without std division, each sequence's token sum divided by "
                "a constant horizon (loss.norm_len, default agent.max_context_tokens)"))
register_recipe(Recipe(
    "gspo", estimator="grpo", policy_loss="gspo", advantage_knobs={"normalize_std": True, "eps": 1e-6},
    aggregation="seq-mean-token-mean", aggregation_fixed=True, group_baseline=True,
    loss_defaults={"clip_eps": 3e-4, "clip_eps_high": 4e-4},
    description="GSPO: GRPO's group-normalised advantages with one clipped importance ratio per sequence "
                "(geometric mean of its token ratios), sequences averaged; clip ranges 3e-4 / 4e-4"))
register_recipe(Recipe(
    "rloo", estimator="rloo", group_baseline=True,
    description="RLOO: leave-one-out group baseline, PPO clipped loss"))
register_recipe(Recipe(
    "reinforce_pp", estimator="reinforce_pp", kl_in_reward=True,
    description="REINFORCE++: token-level return-to-go (KL in the reward), whitened over the batch"))
register_recipe(Recipe(
    "reinforce_pp_baseline", estimator="reinforce_pp_baseline", kl_in_reward=True, group_baseline=True,
    description="REINFORCE++-baseline: the chain's score minus its group's mean score on every action token, "
                "whitened over the batch (KL, if any, in the score or in the loss)"))
register_recipe(Recipe(
    "ppo", estimator="gae", needs_critic=True, kl_in_reward=True,
    advantage_knobs={"gamma": 1.0, "lam": 1.0, "whiten": False},
    description="PPO: GAE over action tokens with a learned critic, KL in the reward; advantage.whiten=True "
                "whitens the advantages over the batch (verl's default)"))
