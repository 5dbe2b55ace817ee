"""The draft-kind registry: a kind is one folder that registers itself (tests/drafts/toykind/ trains, evaluates and
exports through the ordinary entry points with no edit elsewhere), the registry refuses what would make a lookup
ambiguous, and every list of kinds or formats elsewhere is the registry's."""
import dataclasses
import importlib
import json

import pytest
import torch

from specdistill.drafts import registered
from omegaconf import OmegaConf

from specdistill.drafts.registry import (DraftKind, draft_adapter, draft_in_folder, export_formats, exported_kind,
                                         inits_honouring, kind_for_init, kind_named, register_kind, unregister_kind)
from tests.conftest import compose_tiny, make_tiny_lm, make_tokenizer

BUILT_IN = ("dflash", "eagle3", "draft")


@pytest.fixture
def toy():
    """The toy kind registered for one test, and gone after it (a later test sees the built-in kinds only)."""
    import tests.drafts.toykind as module

    if "toy" not in {k.name for k in registered()}:
        module = importlib.reload(module)  # an earlier test unregistered it: its decorator registers it again
    yield module
    unregister_kind("toy")


# ------------------------------------------------------------------------------------------- the toy kind, end to end
def test_a_kind_from_its_own_folder_trains_evaluates_and_exports(toy, tiny_target_dir, tiny_data_file, tmp_path,
                                                                  capsys):
    from specdistill.cli.export import main as export_cli
    from specdistill.eval.run import run as evaluate
    from specdistill.pipeline.run import run as train

    res = train(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, [
        "draft.init=toy", "draft.hidden_size=32", "trainer.export_formats=[toy]", "trainer.max_steps=2",
        "eval.spec_eval=true", "eval.spec_eval_at=end", "eval.prompts=heldout", "eval.num_prompts=2",
        "eval.warmup_prompts=0", "eval.measure_cost=false"]))
    losses = [h["train/loss"] for h in res.history]
    assert res.step == 2 and all(torch.isfinite(torch.tensor(losses)))
    draft_dir = res.final_checkpoint / "draft"
    assert json.loads((draft_dir / "config.json").read_text())["architectures"] == ["ToyDraftForCausalLM"]
    assert json.loads((draft_dir / "config.json").read_text())["hidden_size"] == 32  # the size it honours
    # evaluated in training (eval.spec_eval_at=end): lossless greedy decoding with the toy drafter
    final = json.loads((tmp_path / "o" / "eval" / "final" / "results.json").read_text())
    assert final["greedy_mismatches"] == 0 and final["mean_accept_len"] >= 1.0
    # exported by the pipeline to the toy's own format, and its export is what --check reads back
    export = tmp_path / "o" / "export" / "toy"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["ToyDraftExport"]
    assert export_cli(["--check", str(export), "--target", str(tiny_target_dir)]) == 0
    assert "is a valid toy toy export" in capsys.readouterr().out
    # the export CLI offers its format and writes it from the checkpoint's draft folder
    assert export_cli(["--draft", str(draft_dir), "--format", "toy", "--out", str(tmp_path / "cli")]) == 0
    assert exported_kind(tmp_path / "cli").name == "toy"
    # evaluated from its saved folder by the evaluation entry point: read back as a toy draft, checked, decoded
    r, _ = evaluate(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, [
        f"eval.draft_path={draft_dir}", f"eval.output_dir={tmp_path / 'eval'}", "eval.num_prompts=2",
        "eval.max_new_tokens=6", "eval.batch_sizes=[2]", "eval.measure_cost=false", "eval.warmup_prompts=0"]),
        log=lambda s: None)
    assert r.drafter == "toy" and r.greedy_mismatches == 0


def test_the_toy_kind_is_asked_not_tabled(toy, tiny_target_dir, tiny_data_file, tmp_path):
    """Validation, the export choices and the read-back checks all come from the toy's spec."""
    from specdistill.validation import ConfigError, validate_config
    from tests.conftest import make_tiny_lm, make_tokenizer

    assert "toy" in export_formats() and kind_for_init("toy") is toy.ToyDraft
    assert "toy" in inits_honouring("hidden_size") and "toy" not in inits_honouring("intermediate_size")
    cfg = compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["draft.init=toy", "draft.intermediate_size=64"])
    with pytest.raises(ConfigError, match=r"draft.intermediate_size=64 is not used with draft.init=toy: drop "
                                          r"draft.intermediate_size \(a draft.init=toy draft takes draft.hidden_size"):
        validate_config(cfg, log=None)
    draft = toy.ToyDraftForCausalLM(make_tiny_lm(len(make_tokenizer()), layers=1).config)
    assert draft_adapter(draft).kind == "toy"
    target = make_tiny_lm(len(make_tokenizer()), layers=1)
    target.config.model_type = "mistral"  # what the toy's own check (its spec's fits) refuses
    with pytest.raises(ValueError, match="does not fit the target t: a toy draft of model_type llama"):
        toy.ToyDraft.spec.check_against_target(draft, "d", target, "t", log=lambda s: None)


def _toy_folder(toy, where):
    """A saved (untrained) toy draft: what training writes to checkpoint/draft."""
    toy.ToyDraftForCausalLM(make_tiny_lm(len(make_tokenizer()), layers=1).config).save_pretrained(where)
    return where


def test_the_toy_kind_bounds_the_draft_length_of_the_draft_evaluated(toy, tiny_target_dir, tiny_data_file, tmp_path):
    """The toy's own limit (its spec's max_draft_length) refuses a longer eval.gamma, eval.max_gamma or tree depth
    whenever speculative decoding runs the draft, and the kind asked is the evaluated draft's: the folder at
    eval.draft_path when set (a toy folder is bounded, an LM folder is not, whatever draft.init says), else the one
    draft.init builds."""
    from specdistill.validation import ConfigError, draft_length_errors, validate_config

    most, saved = toy.MAX_DRAFT, _toy_folder(toy, tmp_path / "toy_draft")

    def refused(extra: list[str]) -> list[str]:
        return draft_length_errors(OmegaConf.to_object(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, extra)))

    built = ["draft.init=toy", "eval.spec_eval=true"]
    assert refused(built + [f"eval.gamma={most}"]) == []
    assert refused(built + [f"eval.gamma={most + 1}"]) == [
        f"eval.gamma={most + 1} exceeds what a toy draft proposes ({most} tokens a round): set eval.gamma={most}, or "
        "draft.init=pretrained (an LM draft proposes any number)"]
    deeper = refused(built + ["eval.dynamic_gamma=true", f"eval.max_gamma={most + 2}", "eval.tree.topk=2",
                              f"eval.tree.depth={most + 3}"])
    assert [e.split(" ")[0] for e in deeper] == [f"eval.max_gamma={most + 2}", f"eval.tree.depth={most + 3}"]
    assert refused(["draft.init=toy", "eval.spec_eval=false", f"eval.gamma={most + 1}"]) == []  # no decoding runs it
    assert len(refused([f"eval.draft_path={saved}", f"eval.gamma={most + 1}"])) == 1  # the saved folder's kind
    assert refused(built + [f"eval.draft_path={tiny_target_dir}", f"eval.gamma={most + 1}"]) == []  # an LM folder
    with pytest.raises(ConfigError, match=rf"eval.gamma={most + 1} exceeds what a toy draft proposes"):
        validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, built + [f"eval.gamma={most + 1}"]),
                        log=None)


def test_a_toy_folder_given_as_the_target_is_refused_naming_the_toy_kind(toy, tiny_data_file, tmp_path):
    """The folders the toy kind claims (its checkpoint by its adapter's saved_in, its export by its export
    architectures) are refused as target.path by the kind's name, from config.json alone; once the kind is
    unregistered, nothing claims them (the refusal is the kind's, not a table's)."""
    from specdistill.validation import ConfigError, validate_config

    saved = _toy_folder(toy, tmp_path / "toy_draft")
    toy.export_toy(saved, tmp_path / "toy_export")
    for folder, arch in ((saved, "ToyDraftForCausalLM"), (tmp_path / "toy_export", toy.EXPORT_ARCH)):
        with pytest.raises(ConfigError) as e:
            validate_config(compose_tiny(folder, tiny_data_file, tmp_path), log=None)
        assert (f"target.path='{folder}' is a toy draft (architectures ['{arch}']): it drafts for a target and cannot "
                "be one. Point target.path at the causal LM checkpoint") in str(e.value)
        assert "eval.draft_path" in str(e.value)
    unregister_kind("toy")
    try:
        assert draft_in_folder(saved) is None and draft_in_folder(tmp_path / "toy_export") is None
    finally:
        importlib.reload(toy)  # registered again, for the fixture to unregister


# ------------------------------------------------------------------------------------------- the registry's rules
def test_a_second_kind_of_a_name_is_refused_naming_the_first(toy):
    with pytest.raises(ValueError, match=r"draft kind 'toy' is registered already \(by ToyDraft\)"):
        register_kind(name="toy", inits={"toy2": ()})(type("Other", (toy.ToyDraft,), {}))
    assert kind_named("toy").adapter is toy.ToyDraft  # the first registration stands


def test_an_init_another_kind_builds_and_a_second_catch_all_are_refused():
    from specdistill.drafts import LMDraft

    with pytest.raises(ValueError, match=r"draft.init \['eagle3'\] already builds the 'eagle3' kind"):
        register_kind(name="other", inits={"eagle3": ()})(type("Other", (LMDraft,), {}))
    with pytest.raises(ValueError, match="'draft' is the catch-all kind already"):
        register_kind(name="other", inits={"other": ()}, catch_all=True)(type("Other", (LMDraft,), {}))
    assert {k.name for k in registered()} == set(BUILT_IN)


def test_an_unknown_init_or_kind_names_the_known_ones(tiny_target_dir, tiny_data_file, tmp_path):
    from specdistill.validation import ConfigError, validate_config

    with pytest.raises(ValueError, match="unknown draft.init 'nope'; choose one of .*eagle3.*from_target"):
        kind_for_init("nope")
    with pytest.raises(ValueError, match=r"unknown draft kind 'nope'; the registered kinds are \['dflash', 'draft', "
                                         r"'eagle3'\]"):
        kind_named("nope")
    with pytest.raises(ConfigError, match="unknown draft.init 'nope'; choose one of"):
        validate_config(compose_tiny(tiny_target_dir, tiny_data_file, tmp_path, ["draft.init=nope"]), log=None)


def test_a_spec_is_frozen():
    spec = kind_named("eagle3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.serves_trees = False
    with pytest.raises(TypeError):
        spec.exporters["new"] = spec.exporters["vllm"]
    with pytest.raises(TypeError):
        spec.inits["eagle3"] = ()


def test_the_catch_all_kind_is_tried_last_whatever_the_order_of_registration(toy):
    order = [k.name for k in registered()]
    assert order[-1] == "draft" and order.index("toy") < order.index("draft")
    assert sum(k.catch_all for k in registered()) == 1


def test_each_built_in_kind_registers_itself_with_its_adapter():
    from specdistill.drafts import DFlashDraftKind, Eagle3Draft, LMDraft

    assert [k.name for k in registered()][-1] == "draft"
    for kind, adapter in zip(map(kind_named, BUILT_IN), (DFlashDraftKind, Eagle3Draft, LMDraft)):
        assert isinstance(kind, DraftKind) and kind.adapter is adapter and adapter.spec is kind
        assert adapter.kind == kind.name and adapter.serves_trees == kind.serves_trees  # read from the spec
        assert all(kind_for_init(init) is adapter for init in kind.inits)


def test_the_export_choices_are_the_union_of_the_kinds_formats(capsys):
    """The CLI's --format choices, the hub's and training's format checks are the kinds' own format lists."""
    from specdistill.cli.export import main as export_cli
    from specdistill.config import HubConfig
    from specdistill.hub.push import check_hub_config

    assert kind_named("eagle3").formats == ("vllm", "sglang", "speculators")
    assert kind_named("dflash").formats == ("vllm",) and kind_named("draft").formats == ()
    assert export_formats() == ("vllm", "sglang", "speculators")
    with pytest.raises(SystemExit):
        export_cli(["--format", "nope"])
    assert "--format {vllm,sglang,speculators}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"unknown format 'nope'; choose from \['vllm', 'sglang', 'speculators'\]"):
        check_hub_config(HubConfig(serving_formats=["nope"]))


def test_a_kind_without_formats_says_so_when_asked_to_export(tmp_path):
    with pytest.raises(ValueError, match="a draft draft has no serving export formats: serve its checkpoint folder"):
        kind_named("draft").export(tmp_path, tmp_path / "out", "vllm")
    with pytest.raises(ValueError, match=r"format 'sglang': a dflash draft exports to \['vllm'\]"):
        kind_named("dflash").export(tmp_path, tmp_path / "out", "sglang")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"architectures \['LlamaForCausalLM'\] is no export of a registered draft "
                                         "kind"):
        exported_kind(tmp_path)
