"""Configs: every recipe composes, YAML mirrors the dataclasses, unknown keys fail loudly, overrides beat recipes."""
import pytest
from omegaconf import OmegaConf

from specdistill.config import CONF_DIR, RECIPES_DIR
from specdistill.objectives import make_objective
from specdistill.validation import range_errors
from tests.conftest import compose



def validate_objective(cfg):
    """The composed `objective` as its dataclass (what entry.load_config converts it into)."""
    return make_objective(OmegaConf.to_container(cfg.objective, resolve=True))


RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_composes_and_validates(recipe):
    cfg = compose(recipe, [])
    assert cfg.run_name == recipe
    assert range_errors(cfg) == []  # the recipe's values satisfy the ranges on the schema's fields
    obj = validate_objective(cfg)
    assert obj.name == cfg.objective.name


def test_recipes_exist():
    assert {"sft", "kd"} <= set(RECIPES)


def test_command_line_beats_recipe():
    cfg = compose("kd", ["objective.divergence=jsd", "objective.beta=0.25", "trainer.lr=1e-3", "draft=small_lm"])
    assert cfg.objective.divergence == "jsd" and cfg.objective.beta == 0.25
    assert cfg.trainer.lr == 1e-3 and cfg.draft.init == "config"
    assert validate_objective(cfg).beta == 0.25


def test_unknown_keys_fail_loudly():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose("kd", ["trainer.lrr=1"])
    with pytest.raises(ConfigCompositionException):
        compose("kd", ["objective.divergenze=jsd"])
    cfg = compose("kd", [])
    OmegaConf.set_struct(cfg, False)
    cfg.objective.bogus = 1
    with pytest.raises(ValueError, match="bogus"):
        validate_objective(cfg)
    cfg.objective = {"name": "nope"}
    with pytest.raises(ValueError, match="unknown objective"):
        validate_objective(cfg)
    cfg = compose("kd", ["objective.divergence=kl9"])
    with pytest.raises(ValueError, match="divergence"):
        validate_objective(cfg)


@pytest.mark.parametrize("group", ["target", "draft", "data", "trainer", "eval", "objective"])
def test_group_yaml_options_all_compose(group):
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        overrides = [f"{group}={path.stem}"]
        if "???" in path.read_text():  # options that need a user value
            key = {"target": "target.path", "draft": "draft.path", "data": "data.path"}[group]
            overrides.append(f"{key}=/x")
        cfg = compose(None, overrides)
        assert cfg[group] is not None
        assert range_errors(cfg) == [], path  # the shipped option's values satisfy the schema's ranges
        if group == "objective":
            validate_objective(cfg)


@pytest.mark.parametrize("group", ["trainer", "eval", "hub"])
def test_a_groups_default_yaml_mirrors_its_dataclass(group):
    """conf/<group>/default.yaml lists every field of its dataclass with the dataclass's default, and nothing else."""
    from specdistill.config import EvalConfig, HubConfig, TrainerConfig

    cls = {"trainer": TrainerConfig, "eval": EvalConfig, "hub": HubConfig}[group]
    yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / "default.yaml"))
    assert yaml == OmegaConf.to_container(OmegaConf.structured(cls))


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_loads_into_one_typed_config(recipe):
    """The entry's conversion (entry.load_config) leaves no Hydra container anywhere in the Config the layers read:
    each group is its dataclass, `objective` its objective's dataclass, and the warm-up's objective a dataclass when
    a warm-up runs (None when none does)."""
    import dataclasses

    from omegaconf import Container

    from specdistill.config import Config, EvalConfig, TrainerConfig
    from specdistill.entry import load_config
    from specdistill.objectives import OBJECTIVES

    cfg = load_config(compose(recipe, []), log=None)

    def containers(value, key=""):
        if isinstance(value, Container):
            return [key]
        if dataclasses.is_dataclass(value):
            return [k for f in dataclasses.fields(value) for k in containers(getattr(value, f.name), f"{key}.{f.name}")]
        if isinstance(value, dict):
            return [k for name, v in value.items() for k in containers(v, f"{key}.{name}")]
        if isinstance(value, list):
            return [k for i, v in enumerate(value) for k in containers(v, f"{key}[{i}]")]
        return []

    assert containers(cfg) == []
    assert type(cfg) is Config and type(cfg.trainer) is TrainerConfig and type(cfg.eval) is EvalConfig
    assert type(cfg.objective) is OBJECTIVES[compose(recipe, []).objective.name]
    assert cfg.warmup.objective is None or type(cfg.warmup.objective) in OBJECTIVES.values()
    if recipe == "draft_opd":
        assert cfg.warmup.objective is not None  # warmup.mode=auto without a trained draft.path: it runs
