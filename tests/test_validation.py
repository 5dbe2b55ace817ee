"""Every bad input fails early, by name, before any model loads (specdistill/validation.py)."""
import re
import time

import pytest
from hydra.errors import MissingConfigException

from specdistill.build import build
from specdistill.paths import looks_local
from specdistill.validation import ConfigError, validate_config
from tests.conftest import compose, compose_tiny, tiny_overrides


def test_unknown_recipe_is_refused_and_lists_the_known_ones():
    with pytest.raises(MissingConfigException) as e:
        compose("kdd", [])
    msg = str(e.value)
    print(msg)
    assert "recipe/kdd" in msg and "kd" in msg.split("Available options")[1] and "sft" in msg


def test_data_jsonl_without_data_path_is_refused(no_model_loads):
    cfg = compose("kd", ["data=jsonl"])
    with pytest.raises(ConfigError, match="data.path is required") as e:
        build(cfg)
    print(e.value)
    assert "data=jsonl" in str(e.value)


def test_target_local_without_target_path_is_refused(no_model_loads):
    cfg = compose("kd", ["target=local"])
    with pytest.raises(ConfigError, match="target.path is required") as e:
        build(cfg)
    print(e.value)


@pytest.mark.parametrize("override,key", [("trainer.micro_batch_size=0", "trainer.micro_batch_size=0 must be >= 1"),
                                          ("trainer.lr=-1", "trainer.lr=-1.0 must be > 0"),
                                          ("trainer.grad_accum=0", "trainer.grad_accum=0 must be >= 1"),
                                          ("data.max_malformed_fraction=1.5", "data.max_malformed_fraction=1.5"),
                                          ("eval.top_p=0", "eval.top_p=0.0 must be > 0"),
                                          ("trainer.betas=[0.9,1.0]", "trainer.betas[1]=1.0 must be >= 0 and < 1"),
                                          ("draft.moe.coverage=1.5", "draft.moe.coverage=1.5 must be > 0 and <= 1"),
                                          ("draft.hidden_size=0", "draft.hidden_size=0 must be >= 1")])
def test_numeric_ranges_name_the_key(override, key, tiny_target_dir, tiny_data_file, tmp_path, no_model_loads):
    with pytest.raises(ConfigError) as e:
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, [override]))
    print(e.value)
    assert key in str(e.value)


def test_every_problem_is_listed_at_once(tiny_target_dir, tiny_data_file, tmp_path, no_model_loads):
    with pytest.raises(ConfigError) as e:
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["trainer.lr=-1", "trainer.micro_batch_size=0"]))
    assert "trainer.lr" in str(e.value) and "trainer.micro_batch_size" in str(e.value)


def test_a_relative_data_path_with_a_typo_is_a_local_error_not_a_hub_lookup(tiny_target_dir, tmp_path,
                                                                            no_model_loads):
    t0 = time.perf_counter()
    cfg = compose("kd", tiny_overrides(tiny_target_dir, "data/conversatons.jsonl", tmp_path / "o", tmp_path / "c"))
    with pytest.raises(FileNotFoundError, match="data.path='data/conversatons.jsonl' looks like a local path") as e:
        build(cfg)
    print(e.value)
    assert time.perf_counter() - t0 < 10  # no Hub retries


@pytest.mark.parametrize("path,local", [("./x", True), ("x.jsonl", True), ("data/x.parquet", True), ("~/d", True),
                                        ("/abs/dir", True), ("a/b/c", True), ("org/name", False),
                                        ("embedded:sharegpt", False), ("sharegpt", False)])
def test_looks_local(path, local):
    assert looks_local(path) is local


def test_the_defaults_pass(tiny_target_dir, tiny_data_file, tmp_path):
    assert validate_config(compose("kd", []), log=None) == []
    assert validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path), log=None) == []


def test_ignored_draft_path_is_warned(tiny_target_dir, tiny_data_file, tmp_path, capsys):
    found = validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path,
                                 ["eval.drafter=ngram", f"eval.draft_path={tmp_path}"]))
    out = capsys.readouterr().out
    print(out)
    assert len(found) == 1 and "eval.draft_path" in out and "ignored with eval.drafter='ngram'" in out


@pytest.mark.parametrize("recipe,override,says", [
    ("eagle3", "draft.num_layers=2", "draft.init=eagle3 draft has exactly 1 decoder layer"),
    ("eagle3", "draft.hidden_size=256", "drop draft.hidden_size (give the head capacity with draft.intermediate_size"),
    ("eagle3", "draft.num_key_value_heads=1", "drop draft.num_key_value_heads"),
    ("kd", "draft=from_target draft.intermediate_size=64", "draft.intermediate_size=64 is not used with "
                                                             "draft.init=from_target")])
def test_a_draft_size_the_draft_kind_would_ignore_is_refused(recipe, override, says, tiny_target_dir,
                                                             tiny_data_file, tmp_path, no_model_loads):
    """A size the draft kind would ignore (draft.num_layers=2 for a one-layer EAGLE-3 head) is refused, not dropped."""
    extra = override.split() + (["draft.num_layers=1"] if "num_layers" not in override and recipe == "eagle3" else [])
    with pytest.raises(ConfigError) as e:
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, extra, recipe=recipe))
    print(e.value)
    assert says in str(e.value) and "nothing was loaded" in str(e.value)


def test_the_sizes_each_draft_kind_uses_pass(tiny_target_dir, tiny_data_file, tmp_path):
    for recipe, extra in [("eagle3", ["draft.intermediate_size=96"]), ("kd", ["draft=small_lm", "draft.num_layers=1"]),
                          ("kd", ["draft=from_target", "draft.num_layers=1"])]:
        cfg = compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, extra, recipe=recipe)
        assert validate_config(cfg, log=None) == []


# ------------------------------------------------------------------------------ constraints on the schema's fields
def _outside(rule):
    """A value just outside a rule's range or choices."""
    if rule.choices is not None:
        return "__not_a_choice__"
    r = rule.range
    v = (r.lo if r.lo_open else r.lo - 1) if r.lo is not None else (r.hi if r.hi_open else r.hi + 1)
    return int(v) if v.is_integer() else v  # an int fits int and float settings alike


def test_every_constrained_setting_is_checked_from_its_field():
    """Each constraint on a schema field (specdistill/config.py) is enforced by validation, naming the key, what it
    must be and the default: there is no second table to forget."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    from specdistill.config import Config
    from specdistill.constraints import rules
    from specdistill.validation import range_errors

    base = compose("kd", [])
    assert range_errors(base) == []
    for key, rule in rules(Config).items():
        cfg = base.copy()
        OmegaConf.set_struct(cfg, False)
        try:
            OmegaConf.update(cfg, key, _outside(rule))
        except ValidationError:  # a list setting: one bad element
            OmegaConf.update(cfg, key, [_outside(rule)])
        errors = range_errors(cfg)
        assert errors and errors[0].startswith(key) and "must be" in errors[0], (key, errors)


# Integer and float settings that take any value (seeds).
UNCONSTRAINED = {"seed", "selection_seed"}


def _numeric_fields(cls, prefix=""):
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(nested, type) and dataclasses.is_dataclass(nested):
            yield from _numeric_fields(nested, f"{prefix}{f.name}.")
            continue
        inner = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        inner = [typing.get_args(a)[0] if typing.get_origin(a) is list else a for a in inner]
        if any(a in (int, float) for a in inner) and f.name not in UNCONSTRAINED:
            yield prefix + f.name


def test_every_numeric_setting_carries_a_constraint():
    """A new int or float setting needs a range on its field: `bounded(default, ">= 1")`
    (specdistill/constraints.py)."""
    from specdistill.config import Config
    from specdistill.constraints import rules

    missing = [k for k in _numeric_fields(Config) if k not in rules(Config)]
    assert not missing, f"give these settings a range with bounded(default, '...'): {missing}"


@pytest.mark.parametrize("text,inside,outside", [(">= 1", [1, 7], [0, -1]), ("> 0", [1e-9], [0, -2]),
                                                 ("[0, 1)", [0, 0.5], [1, -0.1]), ("(0, 1]", [1, 0.2], [0, 1.5]),
                                                 ("<= 8", [8, -3], [9])])
def test_a_range_holds_exactly_what_it_says(text, inside, outside):
    from specdistill.constraints import Range

    r = Range.parse(text)
    assert all(r.why_not(v) is None for v in inside) and all(r.why_not(v) for v in outside)
    assert r.why_not(True) and r.why_not(float("nan")) and r.why_not("1")
    with pytest.raises(ValueError, match="write '>= 1'"):
        Range.parse("at least 1")


def test_an_objective_checks_its_fields_by_the_same_rules():
    from specdistill.objectives.draft_opd import DraftOPDObjective

    with pytest.raises(ValueError) as e:
        DraftOPDObjective(gamma=0, replay_ratio=1.5, weighting="x", replay_max_age=None)
    said = str(e.value)
    assert "objective.gamma=0 must be >= 1 (the default is objective.gamma=4)" in said
    assert "objective.replay_ratio=1.5 must be >= 0 and <= 1" in said
    assert "objective.weighting='x' must be one of" in said
    assert "replay_max_age" not in said  # Optional: null is legal


@pytest.mark.parametrize("name", ["sft", "kd", "eagle3", "draft_opd", "moe_kd", "moe_opd", "dflash"])
def test_every_objective_refuses_each_value_outside_its_fields_constraints(name):
    """Every objective dataclass puts its ranges and choices on its fields and checks them on construction: each
    numeric knob carries a constraint (none left to a hand-written check), and a value just outside any of them
    fails naming `objective.<key>`, what it must be and the default."""
    from specdistill.constraints import rules
    from specdistill.objectives import OBJECTIVES

    assert sorted(OBJECTIVES) == sorted(["sft", "kd", "eagle3", "draft_opd", "moe_kd", "moe_opd", "dflash"]), \
        "a new objective: add it to this test's parameters"
    cls = OBJECTIVES[name]
    missing = [k for k in _numeric_fields(cls) if k not in rules(cls)]
    assert not missing, f"objective={name}: give these fields a range with bounded(default, '...'): {missing}"
    cls()  # the defaults pass
    for key, rule in rules(cls).items():
        with pytest.raises(ValueError) as e:
            cls(**{key: _outside(rule)})
        said = str(e.value)
        assert f"objective.{key}=" in said and "must be" in said and "the default is" in said, (name, key, said)


@pytest.mark.parametrize("override,says", [({"max_retries": -1}, "hub.max_retries=-1 must be >= 0"),
                                           ({"backoff_s": -0.5}, "hub.backoff_s=-0.5 must be >= 0")])
def test_the_hub_check_uses_the_schema_ranges(override, says):
    from specdistill.config import HubConfig
    from specdistill.hub.push import check_hub_config

    check_hub_config(HubConfig())
    with pytest.raises(ValueError, match=re.escape(says)):
        check_hub_config(HubConfig(**override))


# ------------------------------------------------------------------------------ small silent cases, refused early
@pytest.mark.parametrize("drafter", ["draft", "ngram", "target"])
def test_gamma_zero_is_refused_for_every_drafter(drafter, no_model_loads):
    """An empty draft run (eval.gamma=0) is no speculative evaluation: refused whatever the drafter, fixed or not."""
    from specdistill.config import EvalConfig
    from specdistill.eval.evaluator import check_eval_config

    with pytest.raises(ValueError, match="eval.gamma=0 must be >= 1"):
        check_eval_config(EvalConfig(gamma=0, drafter=drafter))
    with pytest.raises(ConfigError, match="eval.gamma=0 must be >= 1"):
        validate_config(compose("kd", ["eval.gamma=0", f"eval.drafter={drafter}"]), log=None)


@pytest.mark.parametrize("overrides,refused", [(["run_name=../.."], True), (["run_name=/tmp/elsewhere"], True),
                                               (["run_name=."], True), (["run_name=a/../../b"], True),
                                               (["run_name=exp/a"], False), (["run_name=..x"], False),
                                               (["run_name=/tmp/x", "trainer.output_dir=/tmp/out"], False)])
def test_run_name_stays_inside_the_output_folder(overrides, refused, no_model_loads):
    """outputs/${run_name} with run_name=../.. would write outside outputs/, and an absolute run_name would be
    nested under it: both are refused, with the fix; an explicit trainer.output_dir leaves run_name a plain label."""
    cfg = compose("kd", overrides)
    if refused:
        with pytest.raises(ConfigError, match="must name a folder inside 'outputs/'.*trainer.output_dir=<folder>"):
            validate_config(cfg, log=None)
    else:
        assert validate_config(cfg, log=None) == []


def test_a_draft_vocabulary_larger_than_the_targets_is_refused(tiny_target_dir, tiny_data_file, tmp_path):
    """A draft vocabulary larger than the target's is refused by name (never built smaller than the config records);
    null takes the whole vocabulary."""
    with pytest.raises(ValueError, match=r"draft.draft_vocab_size=1000 is larger than the target's vocabulary \(\d+ "
                                         r"tokens\).*or null for the whole vocabulary"):
        build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["draft.draft_vocab_size=1000"], recipe="eagle3"))
    c = build(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["draft.draft_vocab_size=null"], recipe="eagle3"))
    head = c.accelerator.unwrap_model(c.models.draft)
    assert head.config.draft_vocab_size == head.config.vocab_size
