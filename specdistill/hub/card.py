"""The model card (README.md) pushed with a draft: target, recipe, data, acceptance table, how to serve it."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Optional

from specdistill.config import Config

if TYPE_CHECKING:  # annotations only: the draft kinds are passed in
    from specdistill.drafts import DraftAdapter


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def tau_table(metrics: dict, gamma: int, serves_trees: bool = True) -> str:
    """Markdown tables from the latest metrics: the real speculative eval (spec/*) and the held-out proxy
    (heldout/*); serves_trees: recommended_line's."""
    rows = []
    spec = {k.removeprefix("spec/"): v for k, v in metrics.items() if k.startswith("spec/")}
    if spec:
        rows += ["Real speculative decoding (specdistill.eval, after the latest epoch, "
                 f"{int(spec.get('num_prompts', 0))} prompts):", "",
                 "| metric | value |", "|---|---|"]
        for k, label in (("mean_accept_len", "mean acceptance length tau (tokens / target forward)"),
                         ("alpha", "acceptance rate alpha"), ("speedup", "measured speedup"),
                         ("predicted_speedup", "predicted speedup"), ("greedy_mismatches", "greedy mismatches")):
            if k in spec:
                rows.append(f"| {label} | {_fmt(spec[k])} |")
        pos = [spec[f"accept_rate_pos{i}"] for i in range(1, 64) if f"accept_rate_pos{i}" in spec]
        if pos:
            rows += ["", "| draft position | " + " | ".join(str(i + 1) for i in range(len(pos))) + " |",
                     "|---|" + "---|" * len(pos), "| acceptance | " + " | ".join(f"{a:.3f}" for a in pos) + " |"]
        if "recommended_speedup" in spec:
            rows += ["", recommended_line(spec, serves_trees)]
        rows.append("")
    held = {k.removeprefix("heldout/"): v for k, v in metrics.items() if k.startswith("heldout/")}
    if "mean_accept_len" in held:
        rows += [f"Held-out simulated acceptance (teacher-forced top-1 agreement, gamma {gamma}): "
                 f"tau {held['mean_accept_len']:.3f}", ""]
    return "\n".join(rows) if rows else "No evaluation results yet.\n"


def recommended_line(spec: dict, serves_trees: bool = True) -> str:
    """The cost model's recommended setting (eval.measure_recommended) from spec/* metrics, with the SGLang flags that
    serve it (a chain of gamma is topk 1, gamma steps, gamma + 1 draft tokens). serves_trees=False: the engines serve
    this kind of draft as chains only, so a recommended tree is named as specdistill's decoding."""
    topk, steps, tokens = (int(spec.get(f"recommended_{k}", 0))
                           for k in ("eagle_topk", "num_steps", "num_draft_tokens"))
    measured = (f"Measured {spec['recommended_speedup']:.3f}x "
                f"(predicted {spec['recommended_predicted_speedup']:.3f}x), tau {spec['recommended_tau']:.3f}.")
    if topk == 1:
        return (f"Recommended by the cost model on the evaluation machine: a chain of {steps} (vLLM "
                f"`num_speculative_tokens` {steps}; SGLang `--speculative-num-steps {steps} --speculative-eagle-topk 1 "
                f"--speculative-num-draft-tokens {tokens}`). {measured}")
    tree = f"a token tree of top-{topk}, {steps} steps, {tokens - 1} nodes"
    if not serves_trees:
        return (f"Recommended by the cost model on the evaluation machine: {tree}, as specdistill decodes it (the "
                f"engines serve this draft as chains). {measured}")
    return (f"Recommended by the cost model on the evaluation machine: {tree} (SGLang `--speculative-eagle-topk {topk} "
            f"--speculative-num-steps {steps} --speculative-num-draft-tokens {tokens}`). {measured}")


def model_card(cfg: Config, repo_id: str, metrics: dict, step: int, epoch: int, kind: type[DraftAdapter],
               exports: Optional[list[str]] = None) -> str:
    """The card of a draft of `kind` (its adapter, drafts/: its spec's card data, its serving section); `exports`: the
    serving formats staged next to it."""
    from specdistill.assets import serving_model_id

    target = str(cfg.target.path)
    served = serving_model_id(target)  # what vLLM / SGLang load: never embedded:<name>
    objective = dataclasses.asdict(cfg.objective)
    trainer = {k: getattr(cfg.trainer, k) for k in ("lr", "max_steps", "micro_batch_size", "grad_accum", "seed")}
    data = {k: getattr(cfg.data, k) for k in ("path", "max_rows", "max_length", "packing")}
    gamma = cfg.eval.gamma
    tags = ["speculative-decoding", "draft-model", "specdistill", *kind.spec.card.tags]
    front = ["---", f"library_name: {kind.spec.card.library}",
             "tags:", *[f"- {t}" for t in tags]]
    if "/" in served and not served.startswith(("/", ".", "embedded:", "~")):
        front.append(f"base_model: {served}")  # a hub id, not a local path
    front.append("---")
    return "\n".join(front) + f"""

# {repo_id.split('/')[-1]}

{kind.spec.card.title} for speculative decoding of **{target}**, trained with specdistill
(run `{cfg.run_name}`, objective `{cfg.objective.name}`). Speculative decoding with this draft is
lossless: outputs follow the target's distribution exactly; the draft only changes speed.

Step {step}, epoch {epoch}.

## Training

- Target: `{target}`{f" (served as `{served}`)" if served != target else ""}
- Objective: `{json.dumps(objective)}`
- Data: `{json.dumps(data)}`
- Trainer: `{json.dumps(trainer)}`

The full resolved config is `specdistill/config.yaml`; the latest metrics are `specdistill/metrics.json`.

## Acceptance

{tau_table(metrics, gamma, kind.spec.serves_trees)}
## Serving

{kind.card_section(repo_id, served, exports or [], gamma)}"""
