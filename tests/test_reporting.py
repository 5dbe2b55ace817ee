"""Reporting: the model card names a loadable target, plots show n and no single-point curves from a y-axis at 0,
the in-training speculative evaluation has its own progress bar."""

import pytest

from specdistill.drafts import Eagle3Draft, LMDraft
from specdistill.entry import load_config
from tests.conftest import compose, tiny_overrides


def test_card_serving_commands_name_the_original_hub_id_of_the_embedded_target():
    from specdistill.hub.card import model_card

    cfg = load_config(compose("kd", []), log=None)  # target.path=embedded:smollm2-135m-instruct; nothing is loaded
    for kind in (LMDraft, Eagle3Draft):
        card = model_card(cfg, "me/draft", {}, step=1, epoch=0, kind=kind, exports=["vllm", "sglang"])
        serving = card.split("## Serving")[1]
        assert "embedded:" not in serving, serving
        assert "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct" in serving
        assert "--model-path HuggingFaceTB/SmolLM2-135M-Instruct" in serving
        assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card
    print(serving)


def test_card_for_a_local_target_names_its_absolute_path(tmp_path, monkeypatch):
    from specdistill.hub.card import model_card

    (tmp_path / "my_target").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = compose("kd", ["target.path=./my_target"])
    card = model_card(load_config(cfg, log=None), "me/draft", {}, step=1, epoch=0, kind=LMDraft)
    assert f"vllm serve {tmp_path / 'my_target'}" in card


def test_the_card_names_how_the_recommended_setting_is_served():
    from specdistill.drafts import DFlashDraftKind
    from specdistill.hub.card import recommended_line

    spec = {"recommended_speedup": 1.05, "recommended_predicted_speedup": 1.02, "recommended_tau": 1.8,
            "recommended_eagle_topk": 3.0, "recommended_num_steps": 2.0, "recommended_num_draft_tokens": 6.0}
    tree = recommended_line(spec, Eagle3Draft.serves_trees)
    assert "top-3, 2 steps, 5 nodes" in tree and "--speculative-eagle-topk 3 --speculative-num-steps 2 " \
                                                "--speculative-num-draft-tokens 6`" in tree
    assert "Measured 1.050x (predicted 1.020x), tau 1.800" in tree
    block = recommended_line(spec, DFlashDraftKind.serves_trees)
    assert "as specdistill decodes it (the engines serve this draft as chains)" in block and "SGLang" not in block
    chain = recommended_line(spec | {"recommended_eagle_topk": 1.0, "recommended_num_draft_tokens": 3.0})
    assert "a chain of 2 (vLLM `num_speculative_tokens` 2;" in chain


@pytest.fixture
def ax():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_a_single_point_is_not_drawn_as_a_curve(ax):
    from specdistill.eval.report import curve

    curve(ax, [1], [0.93], [16], "prompts")
    assert ax.lines[0].get_linestyle() == "None"  # a marker, no line
    assert [t.get_text() for t in ax.texts][:1] == ["prompts=16"]
    assert ax.get_ylim()[0] == 0


def test_curves_show_n_per_point_and_start_at_zero(ax):
    from specdistill.eval.report import curve

    curve(ax, [1, 2, 4], [0.95, 0.97, 0.99], [16, 16, 8], "prompts")  # a 4% spread must not fill the plot
    assert ax.lines[0].get_linestyle() == "-"
    assert [t.get_text() for t in ax.texts] == ["prompts=16", "prompts=16", "prompts=8"]
    lo, hi = ax.get_ylim()
    assert lo == 0 and hi >= 0.99


def test_in_training_speculative_eval_has_its_own_progress_bar(tiny_target_dir, tiny_data_file, tmp_path, capfd):
    from specdistill.pipeline.run import run

    cfg = compose("kd", tiny_overrides(tiny_target_dir, tiny_data_file, tmp_path / "o", tmp_path / "cache")
                  + ["trainer.max_steps=2", "eval.spec_eval=true", "eval.prompts=heldout", "eval.num_prompts=2",
                     "eval.warmup_prompts=0", "eval.measure_cost=false"])
    run(cfg)
    out, err = capfd.readouterr()
    print([line for line in out.splitlines() if line.startswith("[spec-eval]")])
    assert "[spec-eval] epoch-0 step 2: speculative decoding of 2 prompts" in out
    bar = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("eval draft gamma=")]
    assert bar and "2/2" in bar[-1] and "<" in bar[-1]  # tqdm: elapsed<remaining (the ETA)
