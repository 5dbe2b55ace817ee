"""Every bad input fails early, by name, before any model loads (specdistill/validation.py)."""
import time

import pytest
from hydra.errors import MissingConfigException

import specdistill.build as build_mod
from specdistill.build import build
from specdistill.validation import ConfigError, looks_local, validate_config
from tests.conftest import compose, tiny_overrides


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any attempt to load a target fails the test: validation must come first."""
    def refuse(cfg):
        raise AssertionError("a model was loaded before the config was validated")
    monkeypatch.setattr(build_mod, "build_target", refuse)
    monkeypatch.setattr(build_mod, "build_tokenizer", refuse)


def _cfg(tiny_target_dir, tiny_data_file, tmp_path, extra=(), recipe="kd"):
    return compose(recipe, tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                   + list(extra))


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
        build(_cfg(tiny_target_dir, tiny_data_file, tmp_path, [override]))
    print(e.value)
    assert key in str(e.value)


def test_every_problem_is_listed_at_once(tiny_target_dir, tiny_data_file, tmp_path, no_model_loads):
    with pytest.raises(ConfigError) as e:
        build(_cfg(tiny_target_dir, tiny_data_file, tmp_path, ["trainer.lr=-1", "trainer.micro_batch_size=0"]))
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
    assert validate_config(_cfg(tiny_target_dir, tiny_data_file, tmp_path), log=None) == []


def test_ignored_draft_path_is_warned(tiny_target_dir, tiny_data_file, tmp_path, capsys):
    found = validate_config(_cfg(tiny_target_dir, tiny_data_file, tmp_path,
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
    """Before: draft=eagle3 draft.num_layers=2 trained the usual one-layer head and said nothing."""
    extra = override.split() + (["draft.num_layers=1"] if "num_layers" not in override and recipe == "eagle3" else [])
    with pytest.raises(ConfigError) as e:
        build(_cfg(tiny_target_dir, tiny_data_file, tmp_path, extra, recipe=recipe))
    print(e.value)
    assert says in str(e.value) and "nothing was loaded" in str(e.value)


def test_the_sizes_each_draft_kind_uses_pass(tiny_target_dir, tiny_data_file, tmp_path):
    for recipe, extra in [("eagle3", ["draft.intermediate_size=96"]), ("kd", ["draft=small_lm", "draft.num_layers=1"]),
                          ("kd", ["draft=from_target", "draft.num_layers=1"])]:
        assert validate_config(_cfg(tiny_target_dir, tiny_data_file, tmp_path, extra, recipe=recipe), log=None) == []
