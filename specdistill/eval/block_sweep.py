"""Block size from the measured cost model: a block drafter (DFlash) evaluated at several block sizes B on the same
prompts, each point a full evaluation (evaluator.evaluate with gamma = B - 1) plus its timed costs, and the B whose
measured throughput is highest named.

Per block size B (one draft forward proposes B - 1 tokens, one target forward verifies B):
  mean_accept_len      tau at gamma = B - 1
  accept_rate_per_pos  a_k for k = 1 .. B-1
  draft_ms_per_round   one propose() in the steady state: the whole block, one forward
  verify_ms            one target forward over B tokens; target_step_ms over 1 token
  predicted_speedup    tau / ((draft_ms_per_round + verify_ms) / target_step_ms): the cost model's speedup
  tokens_per_s, speedup measured, against target-only decoding interleaved per batch
The fastest block size is the one with the highest measured tokens_per_s (the cost model's guess is shown beside it).
A draft trained at one block size runs at another with fewer or more MASK positions: its acceptance there is what the
sweep measures (pass drafts trained per block size to compare trained drafts).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Union

import torch

from specdistill.config import EvalConfig
from specdistill.drafts import draft_adapter


@dataclass
class BlockPoint:
    block_size: int
    mean_accept_len: float
    accept_rate_per_pos: list[float]
    draft_ms_per_round: float
    verify_ms: float
    target_step_ms: float
    predicted_speedup: float
    tokens_per_s: float
    target_only_tokens_per_s: float
    speedup: float
    greedy_mismatches: Union[int, None]


@dataclass
class BlockSweep:
    points: list[BlockPoint]

    @property
    def fastest(self) -> int:
        """The block size with the highest measured tokens/s on this machine."""
        return max(self.points, key=lambda p: p.tokens_per_s).block_size

    def to_dict(self) -> dict:
        return {"fastest_block_size": self.fastest, "points": [asdict(p) for p in self.points]}

    def markdown(self) -> str:
        lines = ["| B | tau | a_1 .. a_(B-1) | draft ms/round | verify ms | target step ms | predicted | tok/s | "
                 "speedup | greedy mismatches |", "|---|---|---|---|---|---|---|---|---|---|"]
        for p in self.points:
            acc = " ".join(f"{a:.2f}" for a in p.accept_rate_per_pos)
            mm = "-" if p.greedy_mismatches is None else p.greedy_mismatches
            lines.append(f"| {p.block_size} | {p.mean_accept_len:.3f} | {acc} | {p.draft_ms_per_round:.2f} | "
                         f"{p.verify_ms:.2f} | {p.target_step_ms:.2f} | {p.predicted_speedup:.3f}x | "
                         f"{p.tokens_per_s:.2f} | {p.speedup:.3f}x | {mm} |")
        lines.append(f"\nFastest block size on this machine (measured tokens/s): B = {self.fastest}")
        return "\n".join(lines)

    def write(self, out_dir) -> dict[str, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "block_sweep.json", "md": out / "block_sweep.md"}
        paths["json"].write_text(json.dumps(self.to_dict(), indent=1))
        paths["md"].write_text(self.markdown() + "\n")
        return paths


def block_size_sweep(target_model, tokenizer, draft: torch.nn.Module, prompts, cfg: EvalConfig,
                     block_sizes: list[int], *, progress: bool = True,
                     log: Callable[[str], None] = print) -> BlockSweep:
    """Evaluate `draft` (a block drafter) at every block size in `block_sizes` with gamma = B - 1; its costs timed
    on the first prompt (timing.measure_cost: medians of steady-state rounds)."""
    from specdistill.decoding import Sampler
    from specdistill.decoding.kv import device_of
    from specdistill.eval.batches import make_batches
    from specdistill.eval.evaluator import evaluate
    from specdistill.eval.timing import measure_cost
    from specdistill.tokens import pad_id

    adapter = draft_adapter(draft)
    first = make_batches([_first_prompt(prompts, tokenizer)], 1, pad_id(tokenizer, None), device_of(target_model))[0]
    points = []
    for B in block_sizes:
        model = adapter.at_block_size(B)
        ecfg = replace(cfg, gamma=B - 1, dynamic_gamma=False, measure_cost=False, batch_sizes=[cfg.batch_size],
                       compare_hf=False)
        r = evaluate(target_model, tokenizer, model, prompts, ecfg, progress=progress, log=log)
        generator = torch.Generator().manual_seed(cfg.seed)
        sampler = Sampler(cfg.temperature, cfg.top_p, generator).for_drafts(cfg.draft_policy)
        c = measure_cost(target_model, draft_adapter(model).drafter(), first, B - 1, sampler)
        draft_round = c.draft_token_ms * (B - 1)
        points.append(BlockPoint(
            block_size=B, mean_accept_len=r.mean_accept_len, accept_rate_per_pos=list(r.accept_rate_per_pos),
            draft_ms_per_round=draft_round, verify_ms=c.verify_ms, target_step_ms=c.target_step_ms,
            predicted_speedup=r.mean_accept_len / ((draft_round + c.verify_ms) / c.target_step_ms),
            tokens_per_s=r.tokens_per_s, target_only_tokens_per_s=r.target_only_tokens_per_s, speedup=r.speedup,
            greedy_mismatches=r.greedy_mismatches))
        log(f"[eval] block size {B}: tau {r.mean_accept_len:.3f}, draft {draft_round:.2f} ms/round, verify "
            f"{c.verify_ms:.2f} ms, {r.tokens_per_s:.2f} tok/s ({r.speedup:.3f}x)")
    sweep = BlockSweep(points)
    log(f"[eval] fastest block size on this machine: {sweep.fastest}")
    return sweep


def _first_prompt(prompts, tokenizer) -> list[int]:
    """The first prompt's token ids: a PromptSet's, a token-id list's, or a message list rendered for generation."""
    from specdistill.data.chat import prompt_ids

    if hasattr(prompts, "ids"):
        return list(prompts.ids[0])
    first = prompts[0]
    return list(first) if first and isinstance(first[0], int) else prompt_ids(tokenizer, first)
