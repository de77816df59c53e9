"""Algorithm recipes: every registered recipe is well formed, `resolve` refuses knobs that would have no
effect (naming the key) and accepts the valid ones, and a newly registered recipe reaches the typed config."""
import dataclasses

import pytest

from agentfly_jax import algorithms
from agentfly_jax.algorithms import recipes
from agentfly_jax.algorithms.recipes import Recipe, RecipeError, get_recipe, recipe_names, register_recipe

BUILTIN = ["drgrpo", "grpo", "gspo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]


def resolve(name, advantage=None, loss=None):
    return get_recipe(name).resolve(advantage or {}, loss or {})


def test_every_registered_recipe_names_a_registered_estimator_and_loss():
    assert set(BUILTIN) <= set(recipe_names())
    for name in recipe_names():
        recipe = get_recipe(name)
        assert recipe.name == name
        assert recipe.estimator in algorithms.advantage_estimator_names(), name
        assert recipe.policy_loss in algorithms.policy_loss_names(), name
        assert recipe.aggregation in algorithms.AGGREGATION_MODES, name
        resolved = recipe.resolve({}, {})  # the defaults alone resolve
        assert resolved.recipe is recipe and resolved.aggregation == recipe.aggregation
        assert dict(resolved.estimator_kwargs) == dict(recipe.advantage_knobs)


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown algorithm 'grop' \(did you mean 'grpo'\?\); known: drgrpo, "):
        get_recipe("grop")


def test_builtin_recipes_are_what_they_say():
    assert resolve("drgrpo").aggregation == "seq-mean-token-sum-norm"
    assert get_recipe("drgrpo").aggregation_fixed
    assert dict(resolve("grpo").estimator_kwargs) == {"normalize_std": True, "eps": 1e-6}
    assert dict(resolve("ppo").estimator_kwargs) == {"gamma": 1.0, "lam": 1.0, "whiten": False}
    assert dict(resolve("ppo", {"whiten": True}).estimator_kwargs)["whiten"] is True
    assert get_recipe("ppo").estimator == "gae"
    assert [n for n in BUILTIN if get_recipe(n).kl_in_reward] == ["ppo", "reinforce_pp", "reinforce_pp_baseline"]
    assert [n for n in BUILTIN if get_recipe(n).aggregation == "token-mean"] == [
        "grpo", "ppo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
    assert [n for n in BUILTIN if get_recipe(n).group_baseline] == [
        "drgrpo", "grpo", "gspo", "reinforce_pp_baseline", "rloo"]
    gspo = resolve("gspo")  # GSPO's own clip ranges and sequence-mean aggregation, overridable clip
    assert (gspo.clip_eps, gspo.clip_eps_high, gspo.aggregation) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert get_recipe("gspo").policy_loss == "gspo" and get_recipe("gspo").aggregation_fixed
    assert resolve("gspo", loss={"clip_eps": 0.01}).clip_eps == 0.01
    with pytest.raises(RecipeError, match="defined by its aggregation"):
        resolve("gspo", loss={"aggregation": "token-mean"})
    with pytest.raises(RecipeError, match=r"config.advantage.whiten has no effect under algorithm 'grpo'"):
        resolve("grpo", {"whiten": True})


@pytest.mark.parametrize("name,advantage,loss,key", [
    ("grpo", {"kl_in_reward_coef": 0.1}, {}, "config.advantage.kl_in_reward_coef"),
    ("rloo", {"kl_in_reward_coef": 0.1}, {}, "config.advantage.kl_in_reward_coef"),
    ("drgrpo", {"kl_in_reward_coef": 0.1}, {}, "config.advantage.kl_in_reward_coef"),
    ("grpo", {"gamma": 0.99}, {}, "config.advantage.gamma"),
    ("rloo", {"normalize_std": False}, {}, "config.advantage.normalize_std"),
    ("reinforce_pp", {"lam": 0.9}, {}, "config.advantage.lam"),
    ("drgrpo", {}, {"aggregation": "token-mean"}, "config.loss.aggregation"),
    ("drgrpo", {}, {"aggregation": "seq-mean-token-mean"}, "config.loss.aggregation"),
    ("grpo", {}, {"norm_len": 512}, "config.loss.norm_len"),
    ("ppo", {}, {"aggregation": "seq-mean-token-mean", "norm_len": 512}, "config.loss.norm_len"),
    ("grpo", {}, {"kl_loss_estimator": "k3"}, "config.loss.kl_loss_estimator"),
    ("rloo", {}, {"kl_loss_estimator": "k1", "kl_loss_coef": 0.0}, "config.loss.kl_loss_estimator"),
    ("ppo", {"kl_in_reward_estimator": "k2"}, {}, "config.advantage.kl_in_reward_estimator"),
    ("grpo", {}, {"kl_loss_coef": 0.1, "kl_loss_estimator": "k4"}, "config.loss.kl_loss_estimator"),
    ("grpo", {}, {"aggregation": "mean"}, "config.loss.aggregation"),
    ("grpo", {}, {"clip_epsilon": 0.2}, "config.loss.clip_epsilon"),
])
def test_resolve_refuses_knobs_without_effect_naming_the_key(name, advantage, loss, key):
    with pytest.raises(RecipeError) as err:
        resolve(name, advantage, loss)
    message = str(err.value)
    assert key in message and "\n" not in message
    assert isinstance(err.value, ValueError)  # TrainConfig turns it into a ConfigError


def test_refusals_say_what_to_do():
    with pytest.raises(RecipeError, match="use config.loss.kl_loss_coef"):
        resolve("grpo", {"kl_in_reward_coef": 0.1})
    with pytest.raises(RecipeError, match=r"did you mean 'clip_eps'\?"):
        resolve("grpo", {}, {"clip_epsilon": 0.2})
    with pytest.raises(RecipeError, match="algorithm 'rloo'.*it takes config.advantage: nothing"):
        resolve("rloo", {"normalize_std": False})
    with pytest.raises(RecipeError, match="it takes config.advantage: eps, normalize_std$"):
        resolve("grpo", {"gamma": 0.99})


@pytest.mark.parametrize("name,advantage,loss", [
    ("grpo", {"normalize_std": False, "eps": 1e-5}, {"kl_loss_coef": 0.05, "kl_loss_estimator": "k2"}),
    ("grpo", {}, {"aggregation": "seq-mean-token-mean", "clip_eps_high": 0.28, "dual_clip": 3.0, "is_cap": 2.0,
                  "logprob_chunk": 64, "entropy_coef": 0.01, "temperature": 0.7}),
    ("drgrpo", {}, {"aggregation": "seq-mean-token-sum-norm", "norm_len": 1024}),
    ("drgrpo", {}, {"norm_len": 256}),
    ("rloo", {}, {"kl_loss_coef": 0.1}),
    ("reinforce_pp", {"kl_in_reward_coef": 0.01, "kl_in_reward_estimator": "k3"}, {}),
    ("ppo", {"gamma": 0.99, "lam": 0.95, "kl_in_reward_coef": 0.05}, {"kl_loss_coef": 0.02}),
    ("ppo", {"kl_in_reward_coef": None, "gamma": None}, {"norm_len": None, "aggregation": None}),  # None = unset
])
def test_resolve_accepts_valid_knobs(name, advantage, loss):
    resolved = resolve(name, advantage, loss)
    for key, value in advantage.items():
        if value is None:
            continue
        if key == "kl_in_reward_coef":
            assert resolved.kl_in_reward_coef == value
        elif key == "kl_in_reward_estimator":
            assert resolved.kl_in_reward_estimator == value
        else:
            assert resolved.estimator_kwargs[key] == value
    for key, value in loss.items():
        if value is not None:
            assert getattr(resolved, key) == value, key


def test_resolve_defaults():
    r = resolve("grpo")
    assert (r.clip_eps, r.clip_eps_high, r.dual_clip, r.kl_loss_coef, r.entropy_coef, r.temperature,
            r.logprob_chunk, r.is_cap) == (0.2, None, None, 0.0, 0.0, 1.0, None, None)
    assert (r.kl_in_reward_coef, r.kl_in_reward_estimator, r.kl_loss_estimator) == (0.0, "k1", "k3")
    assert resolve("drgrpo").norm_len is None  # TrainConfig fills in agent.max_context_tokens
    # the caller's mappings are not modified
    advantage, loss = {"gamma": 0.9}, {"norm_len": None}
    resolve("ppo", advantage, loss)
    assert advantage == {"gamma": 0.9} and loss == {"norm_len": None}


@pytest.mark.parametrize("name,advantage,loss,reference,critic", [
    ("grpo", {}, {}, False, False),
    ("grpo", {}, {"kl_loss_coef": 0.01}, True, False),
    ("drgrpo", {}, {}, False, False),
    ("rloo", {}, {"kl_loss_coef": 0.0}, False, False),
    ("reinforce_pp", {}, {}, False, False),
    ("reinforce_pp", {"kl_in_reward_coef": 0.01}, {}, True, False),
    ("ppo", {}, {}, False, True),
    ("ppo", {"kl_in_reward_coef": 0.05}, {}, True, True),
    ("ppo", {}, {"kl_loss_coef": 0.05}, True, True),
])
def test_needs_reference_and_critic(name, advantage, loss, reference, critic):
    resolved = resolve(name, advantage, loss)
    assert resolved.needs_reference is reference
    assert resolved.needs_critic is critic


def test_recipe_definition_is_checked():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        Recipe("test_bad_estimator", estimator="nope")
    with pytest.raises(ValueError, match="unknown policy loss"):
        Recipe("test_bad_loss", estimator="grpo", policy_loss="nope")
    with pytest.raises(ValueError, match="aggregation 'mean'"):
        Recipe("test_bad_agg", estimator="grpo", aggregation="mean")
    with pytest.raises(ValueError, match=r"estimator 'rloo' takes no \['gamma'\]"):
        Recipe("test_bad_knob", estimator="rloo", advantage_knobs={"gamma": 1.0})
    with pytest.raises(ValueError, match="takes no per-token KL"):
        Recipe("test_bad_kl", estimator="grpo", kl_in_reward=True)
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_recipe(Recipe("grpo", estimator="grpo"))
    assert "test_bad_estimator" not in recipe_names()


@pytest.fixture
def scratch_recipe():
    """A recipe registered under a unique name for one test, removed from the registry afterwards."""
    name = "test_recipe_rloo_seq_mean"
    recipe = register_recipe(Recipe(name, estimator="rloo", aggregation="seq-mean-token-mean",
                                    description="RLOO with a per-sequence loss mean (test only)"))
    try:
        yield recipe
    finally:
        recipes._RECIPES.pop(name, None)


def test_a_registered_recipe_reaches_the_typed_config(scratch_recipe):
    from agentfly_jax.trainer.config import ConfigError, TrainConfig
    from experiments import quickstart

    name = scratch_recipe.name
    assert get_recipe(name) is scratch_recipe and name in recipe_names()
    c = quickstart.get_config()
    c.algorithm = name
    cfg = TrainConfig.build(c)
    resolved = cfg.resolved_algorithm()
    assert cfg.algorithm == name and resolved.recipe is scratch_recipe
    assert resolved.aggregation == "seq-mean-token-mean" and resolved.clip_eps_high == 0.28
    assert not resolved.needs_critic and not resolved.needs_reference
    # its knobs are refused like the built-ins'
    c.advantage.normalize_std = False
    with pytest.raises(ConfigError, match=f"config.advantage.normalize_std has no effect under algorithm '{name}'"):
        TrainConfig.build(c)


def test_scratch_recipe_was_cleaned_up():
    assert not any(n.startswith("test_") for n in recipe_names())
    assert sorted(recipes._RECIPES) == recipe_names()


def test_resolved_algorithm_is_frozen():
    resolved = resolve("grpo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.clip_eps = 0.3
