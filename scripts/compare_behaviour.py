"""Same recipes, same losses, same evaluator numbers: run every recipe on the tests' tiny models with fixed seeds and
print the losses and a speculative evaluation, as JSON. Run it from two checkouts and diff the outputs:

  PYTHONPATH=/path/to/old python scripts/compare_behaviour.py > old.json
  PYTHONPATH=. python scripts/compare_behaviour.py > new.json

Works on checkouts before and after the package moves (recipes at the top level or inside the package).
"""
import json
import sys
import tempfile
from pathlib import Path


def main() -> int:
    import torch

    torch.set_num_threads(1)
    from tests.conftest import compose, conversations, make_tiny_lm, make_tokenizer, tiny_overrides

    try:
        from specdistill.pipeline.run import build_components as build
    except ImportError:
        from specdistill.build import build
    from specdistill.train.loop import fit

    root = Path(tempfile.mkdtemp())
    tok = make_tokenizer()
    target = make_tiny_lm(len(tok))
    (root / "t").mkdir()
    target.save_pretrained(root / "t")
    tok.save_pretrained(root / "t")
    data = root / "conv.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in conversations(96)))
    out = {}
    for recipe in ("sft", "kd", "eagle3", "draft_opd"):
        over = tiny_overrides(root / "t", data, root / recipe, root / "cache") + ["trainer.max_steps=3",
                                                                                  "trainer.lr=3e-3"]
        c = build(compose(recipe, over))
        res = fit(c)
        out[recipe] = {"losses": [round(h["train/loss"], 6) for h in res.history if "train/loss" in h],
                       "heldout_tau": round(res.heldout_after["heldout/mean_accept_len"], 6)}
    from specdistill.config import EvalConfig
    from specdistill.eval.evaluator import evaluate

    draft = make_tiny_lm(len(tok), layers=1, seed=1).eval()
    prompts = [[{"role": "user", "content": "the cat sat on the mat"}], [{"role": "user", "content": "hello what is"}]]
    r = evaluate(target.eval(), tok, draft, prompts, EvalConfig(num_prompts=2, max_new_tokens=12, gamma=3,
                                                                  measure_cost=False, warmup_prompts=0), progress=False,
                 log=lambda *_: None)
    out["evaluator"] = {"tau": r.mean_accept_len, "accept_rate_per_pos": r.accept_rate_per_pos,
                        "greedy_mismatches": r.greedy_mismatches}
    json.dump(out, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
