"""Two sets of greedy answers to the same prompts (an engine's and our decoder's): which prompts differ, and whether
each first difference sits at a near-tie of the target's logits.

At T=0 both answer with the target's argmax, but vLLM's kernels and ours add in different orders: where the target's
two best logits are within rounding of each other either token may win, and the answers part there legitimately.
A difference anywhere else is a real mismatch (other prompts, other settings, a bug). This module knows nothing about
engines or how the answers were made; scripts/regen_compare.py reads them from stores or decodes them.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch


@dataclass(frozen=True)
class TieMargin:
    """Two logits x >= y are tied when x - y <= absolute, or x - y <= relative * |x|."""
    absolute: float = 1e-3
    relative: float = 1e-3

    def holds(self, top: float, other: float) -> bool:
        gap = top - other
        return gap <= self.absolute or gap <= self.relative * abs(top)


@dataclass(frozen=True)
class Mismatch:
    """The first answer position where two answers to one prompt differ."""
    row: int
    position: int  # index into the answers (0 = the first answer token)
    ref_token: Optional[int]  # None: this answer ended here and the other did not
    other_token: Optional[int]
    top2_tokens: tuple[int, ...]  # the target's two best tokens after prompt + the shared prefix
    top2_logits: tuple[float, ...]
    gap: Optional[float]  # the best logit minus the lower of the two emitted tokens' logits
    near_tie: bool  # both emitted tokens are within the margin of the best logit


@dataclass
class Comparison:
    prompts: int
    identical: int
    margin: TieMargin
    mismatches: list[Mismatch] = field(default_factory=list)

    @property
    def near_ties(self) -> list[Mismatch]:
        return [m for m in self.mismatches if m.near_tie]

    @property
    def real(self) -> list[Mismatch]:
        return [m for m in self.mismatches if not m.near_tie]

    def summary(self) -> dict:
        return {"prompts": self.prompts, "identical": self.identical, "mismatching": len(self.mismatches),
                "near_ties": len(self.near_ties), "real_mismatches": len(self.real), "margin": asdict(self.margin)}

    def to_dict(self) -> dict:
        return {**self.summary(), "mismatches": [asdict(m) for m in self.mismatches]}


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    """The first index where a and b differ (the shorter's length when one extends the other); None when equal."""
    if a == b:
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@torch.no_grad()
def classify(model, prompt: list[int], ref: list[int], other: list[int], row: int, margin: TieMargin) -> Mismatch:
    """The first difference of two answers to `prompt`, judged by the target's logits after prompt + their shared
    prefix: a near-tie when both emitted tokens score within `margin` of the best one."""
    k = first_difference(ref, other)
    a = ref[k] if k < len(ref) else None
    b = other[k] if k < len(other) else None
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(ref[:k])], device=device)  # (1, P + k)
    logits = model(input_ids=ids).logits[0, -1].float()  # (V,)
    top = logits.topk(2)
    best = float(top.values[0])
    if a is None or b is None:  # one answer stopped where the other went on: not a choice between two tokens
        gap, tied = None, False
    else:
        lower = min(float(logits[a]), float(logits[b]))
        gap, tied = best - lower, margin.holds(best, lower)
    return Mismatch(row, k, a, b, tuple(top.indices.tolist()), tuple(round(float(x), 6) for x in top.values), gap,
                    tied)


def compare_answers(model, prompts: list[list[int]], ref: list[list[int]], other: list[list[int]],
                    margin: TieMargin = TieMargin()) -> Comparison:
    """Row by row: identical answers, or the first difference classified (one target forward per differing row)."""
    if not len(prompts) == len(ref) == len(other):
        raise ValueError(f"{len(prompts)} prompts, {len(ref)} and {len(other)} answers: compare the same prompts")
    out = Comparison(len(prompts), 0, margin)
    for r, (p, a, b) in enumerate(zip(prompts, ref, other)):
        if a == b:
            out.identical += 1
        else:
            out.mismatches.append(classify(model, p, a, b, r, margin))
    return out


@dataclass
class StoreAnswers:
    """Rows of a regenerated store split into prompts and answers, in the order of `parts` and of rows within."""
    prompts: list[list[int]]
    answers: list[list[int]]
    settings: dict
    parts: list[int]


def present_parts(root: Path) -> list[int]:
    """Indices of the parts a store holds (a shard's store holds every n-th)."""
    return sorted(int(f.name[5:10]) for f in Path(root).glob("part-*.safetensors"))


def store_answers(root: Path, parts: Optional[list[int]] = None) -> StoreAnswers:
    """Read these parts of a store (default: every part it holds); a missing one is an error naming it."""
    import json

    from safetensors.torch import load_file

    from specdistill.data.regenerated import part_path

    root = Path(root)
    settings = json.loads((root / "settings.json").read_text())
    parts = present_parts(root) if parts is None else list(parts)
    missing = [i for i in parts if not part_path(root, i).exists()]
    if missing:
        raise FileNotFoundError(f"{root} lacks parts {missing[:5]}: compare parts both stores hold")
    prompts, answers = [], []
    for i in parts:
        t = load_file(str(part_path(root, i)))
        for ids, p in zip(torch.split(t["ids"], t["lengths"].tolist()), t["prompt_lengths"].tolist()):
            prompts.append(ids[:p].tolist())
            answers.append(ids[p:].tolist())
    return StoreAnswers(prompts, answers, settings, parts)


def report_md(cmp: Comparison, title: str, command: str, ref_name: str, other_name: str) -> str:
    """The comparison as markdown: the counts, then one line per mismatching prompt."""
    s = cmp.summary()
    lines = [f"# {title}", "", f"Command: `{command}`", "",
             f"{s['prompts']} prompts at T=0: {s['identical']} identical, {s['mismatching']} differ: "
             f"{s['near_ties']} at a near-tie of the target's logits (within {cmp.margin.absolute:g} absolute or "
             f"{cmp.margin.relative:g} relative of the best), {s['real_mismatches']} real mismatches.", "",
             f"| row | answer position | {ref_name} token | {other_name} token | target top-2 | gap | near-tie |",
             "|---|---|---|---|---|---|---|"]
    for m in cmp.mismatches:
        gap = "-" if m.gap is None else f"{m.gap:.3g}"
        lines.append(f"| {m.row} | {m.position} | {m.ref_token} | {m.other_token} | {list(m.top2_tokens)} | {gap} | "
                     f"{'yes' if m.near_tie else 'no'} |")
    return "\n".join(lines) + "\n"
