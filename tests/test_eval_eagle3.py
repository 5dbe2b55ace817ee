"""The evaluator scores EAGLE-3 heads end to end: lossless greedy output, and a saved head loads by its config."""
import torch

from specdistill.config import EvalConfig
from specdistill.eval.evaluator import evaluate
from specdistill.drafts import load_trained_draft
from specdistill.drafts.eagle3.model import Eagle3Head, build_eagle3
from tests.conftest import make_tiny_lm, make_tokenizer

PROMPTS = [[{"role": "user", "content": "tell me about the cat and the dog"}],
           [{"role": "user", "content": "what is one two three"}]]


def test_eagle3_head_in_the_evaluator_is_lossless(tmp_path):
    torch.set_num_threads(1)
    tok = make_tokenizer()
    target = make_tiny_lm(len(tok), layers=4, hidden=64).eval().requires_grad_(False)
    head = build_eagle3(target, torch.arange(200), None).eval()
    head.save_pretrained(tmp_path / "h")
    loaded = load_trained_draft(tmp_path / "h")
    assert isinstance(loaded, Eagle3Head)
    cfg = EvalConfig(gamma=3, max_new_tokens=12, batch_size=2, batch_sizes=[2], warmup_prompts=0, ignore_eos=True,
                     measure_cost=True)  # the cost timing starts the head from the target's features too
    r = evaluate(target, tok, loaded, PROMPTS, cfg, progress=False)
    assert r.greedy_mismatches == 0
    assert r.cost is not None and r.cost.draft_token_ms > 0 and r.cost.c > 0
    assert 1.0 <= r.mean_accept_len <= 4.0 and len(r.accept_rate_per_pos) == 3
