"""Acceptance by output position (eval/metrics.py: output_position_buckets, output_position_summary): exact counts on
hand-made rounds and on a drafter that is right for the first N output tokens only, intervals around the estimate,
the evaluator's results.json / results.md / plot, and the setting's validation."""
import json

import pytest
import torch

from specdistill.config import EvalConfig
from specdistill.decoding import RoundRecord
from specdistill.decoding.drafters import Drafter, OracleDrafter, Proposal
from specdistill.eval.evaluator import check_eval_config, evaluate
from specdistill.eval.metrics import output_position_summary
from specdistill.output_positions import DEFAULT_POSITION_BUCKETS, check_position_buckets, output_position_buckets
from specdistill.eval.report import write_report


def _round(offset: list[int], num_accepted: list[int], gamma: int, active=None, emitted=None) -> RoundRecord:
    B = len(offset)
    n = torch.tensor(num_accepted)
    k = torch.arange(gamma).expand(B, gamma)
    z = torch.zeros(B, dtype=torch.long)
    return RoundRecord(gamma=gamma, active=torch.ones(B, dtype=torch.bool) if active is None else torch.tensor(active),
                       offset=torch.tensor(offset), draft_tokens=z[:, None].expand(B, gamma),
                       accepted=k < n[:, None], num_accepted=n, next_token=z,
                       num_emitted=n + 1 if emitted is None else torch.tensor(emitted), alpha=(k < n[:, None]).float())


def test_worked_example_of_the_docstring():
    rounds = [_round([0], [2], 2), _round([3], [0], 2), _round([5], [1], 2)]
    b = output_position_buckets(rounds, (0, 4))
    assert [x.name for x in b] == ["0_3", "4_plus"] and [x.label for x in b] == ["0-3", "4+"]
    assert [x.rounds.tolist() for x in b] == [[2], [1]]
    assert [x.proposed.tolist() for x in b] == [[4], [2]]
    assert [x.accepted.tolist() for x in b] == [[2], [1]]
    assert [x.tokens.tolist() for x in b] == [[4], [2]]


def test_a_round_counts_where_it_starts_and_inactive_rows_not_at_all():
    # row 0 starts a round at 127 that runs past 128: it stays in 0-127; row 1 is done (inactive) in the second round
    rounds = [_round([0, 0], [4, 1], 4), _round([127, 2], [3, 4], 4, active=[True, False], emitted=[4, 0]),
              _round([131, 2], [0, 0], 4, active=[True, False], emitted=[1, 0])]
    b = {x.name: x for x in output_position_buckets(rounds)}
    assert list(b) == ["0_127", "128_255", "256_511", "512_1023", "1024_plus"]
    assert b["0_127"].rounds.tolist() == [2, 1] and b["0_127"].accepted.tolist() == [7, 1]
    assert b["0_127"].proposed.tolist() == [8, 4] and b["0_127"].tokens.tolist() == [9, 2]
    assert b["128_255"].rounds.tolist() == [1, 0] and b["128_255"].accepted.tolist() == [0, 0]
    assert all(x.rounds.sum() == 0 for n, x in b.items() if n not in ("0_127", "128_255"))
    # every active row-round lands in exactly one bucket
    assert sum(int(x.rounds.sum()) for x in b.values()) == sum(int(r.active.sum()) for r in rounds)


@pytest.mark.parametrize("starts", [[], [1, 8], [0, 8, 8], [0, 16, 8], [0, -4], [0, 2.5]])
def test_bad_bucket_starts_are_refused_with_the_fix(starts):
    with pytest.raises(ValueError, match="increasing integers beginning at 0"):
        check_position_buckets(starts)
    with pytest.raises(ValueError, match="eval.position_buckets|eval settings"):
        check_eval_config(EvalConfig(position_buckets=starts))


def test_default_buckets_suit_long_outputs():
    assert EvalConfig().position_buckets == list(DEFAULT_POSITION_BUCKETS) == [0, 128, 256, 512, 1024]
    check_position_buckets(EvalConfig().position_buckets)


def _sample(prompt, **cells):
    return {"prompt": prompt, "output_buckets": {name: dict(zip(("rounds", "tokens", "proposed", "accepted"), c))
                                                 for name, c in cells.items()}}


def test_summary_sums_per_bucket_and_its_intervals_bracket_the_estimate():
    g = torch.Generator().manual_seed(0)
    samples = []
    for p in range(20):
        rounds = int(torch.randint(5, 30, (1,), generator=g))
        acc = int(torch.randint(0, 4 * rounds, (1,), generator=g))
        late = int(torch.randint(1, 10, (1,), generator=g))
        cells = {"0_7": (rounds, rounds + acc, 4 * rounds, acc)}
        if p % 2:  # only odd prompts reach the second bucket
            cells["8_plus"] = (late, late, 4 * late, 0)
        samples.append(_sample(p, **cells))
    rows = output_position_summary(samples, [0, 8])
    assert [r["name"] for r in rows] == ["0_7", "8_plus"] and [r["prompts"] for r in rows] == [20, 10]
    early = rows[0]
    cells = [s["output_buckets"]["0_7"] for s in samples]
    assert early["tau"] == sum(c["tokens"] for c in cells) / sum(c["rounds"] for c in cells)
    assert early["accept_rate"] == sum(c["accepted"] for c in cells) / sum(c["proposed"] for c in cells)
    for key in ("tau", "accept_rate"):
        lo, hi = early[f"{key}_ci95"]
        assert lo < early[key] < hi
    assert rows[1]["accept_rate"] == 0 and rows[1]["accept_rate_ci95"] == [0.0, 0.0] and rows[1]["tau"] == 1.0
    # a bucket reached by one prompt has no interval; a bucket no prompt reached has no row
    one = output_position_summary([_sample(0, **{"0_7": (3, 6, 12, 3)})], [0, 8, 16])
    assert len(one) == 1 and one[0]["tau_ci95"] is None and one[0]["accept_rate"] == 0.25


class RightForFirst(Drafter):
    """Drafts the target's greedy continuation (an oracle replay) at output positions < n and a wrong token from n
    on: at temperature 0 a round at offset o accepts min(K, max(0, n - o)) of its K drafts."""

    def __init__(self, target_model, max_new_tokens: int, n: int):
        self.oracle, self.n = OracleDrafter(target_model, max_new_tokens), n
        self.vocab_size = self.oracle.vocab_size

    def prepare(self, input_ids, attention_mask):
        self.oracle.prepare(input_ids, attention_mask)

    def start(self, *args, **kwargs):
        self.oracle.start(*args, **kwargs)

    def propose(self, shape, sampler):
        k = shape.size
        tokens = self.oracle.propose(shape, sampler).tokens                               # (B, k)
        at = self.oracle.offset[:, None] + torch.arange(k, device=tokens.device)     # (B, k) output positions
        return Proposal(torch.where(at < self.n, tokens, (tokens + 1) % self.vocab_size), None)

    def commit(self, num_accepted, next_token, active, target_hidden=None, path=None):
        self.oracle.commit(num_accepted, next_token, active, target_hidden, path)


def _expected(n: int, gamma: int, max_new: int, starts: list[int]) -> dict[str, list[int]]:
    """The decoder's rounds for RightForFirst, by hand: K = min(gamma, budget left - 1) drafts (the token after the
    last draft comes free), min(K, n - o) accepted, accepted + 1 emitted; per bucket [rounds, tokens, proposed,
    accepted]."""
    out = {}
    o = 0
    while o < max_new:
        K = min(gamma, max_new - o - 1)
        acc = min(K, max(0, n - o))
        i = max(j for j, s in enumerate(starts) if s <= o)
        name = f"{starts[i]}_plus" if i == len(starts) - 1 else f"{starts[i]}_{starts[i + 1] - 1}"
        cell = out.setdefault(name, [0, 0, 0, 0])
        for j, v in enumerate((1, acc + 1, K, acc)):
            cell[j] += v
        o += acc + 1
    return out


def test_a_drafter_right_only_early_gives_the_expected_buckets_through_the_evaluator(target, tok, tmp_path):
    n, gamma, max_new, starts = 10, 3, 24, [0, 8, 16]
    want = _expected(n, gamma, max_new, starts)
    # drafts right in 0-7, right then wrong across 8-15, wrong from 16 on
    assert want == {"0_7": [2, 8, 6, 6], "8_15": [6, 8, 18, 2], "16_plus": [8, 8, 18, 0]}
    prompts = [[5, 9, 14, 3], [7, 7, 20], [11, 4, 6, 8, 2], [3, 17]]
    cfg = EvalConfig(gamma=gamma, max_new_tokens=max_new, batch_size=1, batch_sizes=[1], warmup_prompts=0,
                     ignore_eos=True, measure_cost=False, position_buckets=starts)
    r = evaluate(target, tok, RightForFirst(target, max_new, n), prompts, cfg, progress=False)
    assert r.greedy_mismatches == 0
    rows = {b["name"]: b for b in r.accept_by_output_position}
    assert list(rows) == list(want)
    for name, (rounds, tokens, proposed, accepted) in want.items():
        b = rows[name]
        assert (b["prompts"], b["rounds"], b["tokens"], b["proposed"], b["accepted"]) == (
            len(prompts), rounds * len(prompts), tokens * len(prompts), proposed * len(prompts),
            accepted * len(prompts))
        assert b["tau"] == tokens / rounds and b["accept_rate"] == accepted / proposed
        # every prompt the same: the bootstrap interval is the point
        assert b["tau_ci95"] == pytest.approx([b["tau"]] * 2) and b["accept_rate_ci95"] == pytest.approx(
            [b["accept_rate"]] * 2)
    assert sum(b["rounds"] for b in r.accept_by_output_position) == r.target_forwards
    assert r.flat()["spec/accept_bucket_0_7"] == 1.0 and r.flat()["spec/accept_bucket_16_plus"] == 0.0

    paths = write_report(r, tmp_path)
    data = json.loads(paths["results.json"].read_text())
    assert data["position_buckets"] == starts
    assert [b["label"] for b in data["accept_by_output_position"]] == ["0-7", "8-15", "16+"]
    assert data["accept_by_output_position"][1]["accept_rate_ci95"] == pytest.approx([2 / 18] * 2)
    md = paths["results.md"].read_text()
    assert "## Acceptance against output position" in md
    assert "| 0-7 | 4 | 8 | 4.000 [4.000, 4.000] | 1.000 [1.000, 1.000] |" in md
    assert "| 16+ | 4 | 32 | 1.000 [1.000, 1.000] | 0.000 [0.000, 0.000] |" in md
    assert paths["accept_by_output_position.png"].stat().st_size > 0
    outputs = [json.loads(x) for x in paths["outputs.jsonl"].read_text().splitlines()]
    assert all(s["output_buckets"]["8_15"] == dict(zip(("rounds", "tokens", "proposed", "accepted"), want["8_15"]))
               for s in outputs)


def _eval_dir(path, late_accepted: int, buckets: bool = True):
    """An evaluator output folder of 6 prompts: bucket 0-127 the same in every run, 128+ accepting `late_accepted`
    (+ the prompt index) of 40 proposed drafts over 10 rounds."""
    path.mkdir()
    rows = []
    for p in range(6):
        row = {"prompt": p, "new_tokens": 100, "target_forwards": 40, "reached_per_pos": [40], "accepted_per_pos": [20]}
        if buckets:
            row["output_buckets"] = {"0_127": {"rounds": 30, "tokens": 60 + p, "proposed": 120, "accepted": 30 + p},
                                     "128_plus": {"rounds": 10, "tokens": 10 + late_accepted + p, "proposed": 40,
                                                  "accepted": late_accepted + p}}
        rows.append(row)
    (path / "outputs.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (path / "results.json").write_text(json.dumps({"draft_policy": "greedy", "prompts": "p", "max_new_tokens": 200,
                                                   "temperature": 0.0, "gamma": 4}))
    return str(path)


def test_compare_evals_pairs_each_bucket_of_output_position(tmp_path):
    from specdistill.cli.compare_evals import main

    base, better = _eval_dir(tmp_path / "kd", 4), _eval_dir(tmp_path / "opd", 8)
    res = main([base, better, "--out", str(tmp_path / "cmp")])
    table = res["by_output_position"]
    assert list(table) == ["0_127", "128_plus"] and table["128_plus"]["label"] == "128+"
    early, late = table["0_127"]["runs"], table["128_plus"]["runs"]
    assert early[better]["accept_rate_ratio"] == 1.0 and early[better]["accept_rate_ratio_ci95"] == [1.0, 1.0]
    want = (6 * 8 + 15) / (6 * 4 + 15)  # ratio of sums over the six prompts
    assert late[better]["accept_rate_ratio"] == pytest.approx(want)
    lo, hi = late[better]["accept_rate_ratio_ci95"]
    assert 1.0 < lo <= want <= hi
    assert late[better]["tau"] == pytest.approx(sum(10 + 8 + p for p in range(6)) / 60)
    lo, hi = late[better]["tau_ci95"]
    assert lo <= late[better]["tau"] <= hi
    assert late[base]["accept_rate_ratio"] == 1.0 and late[base]["prompts"] == 6
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| 128+ | " + better + " | 6 | " in md and "Per bucket of output position" in md
    saved = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert saved["by_output_position"]["128_plus"]["runs"][better]["accept_rate_ratio"] == pytest.approx(want)


def test_compare_evals_without_buckets_in_one_run_has_no_bucket_table(tmp_path):
    from specdistill.cli.compare_evals import main

    base, other = _eval_dir(tmp_path / "kd", 4), _eval_dir(tmp_path / "old", 8, buckets=False)
    res = main([base, other, "--out", str(tmp_path / "cmp")])
    assert res["by_output_position"] == {} and res["overall"][other]["prompts"] == 6
    assert "Per bucket of output position" not in (tmp_path / "cmp" / "compare.md").read_text()
