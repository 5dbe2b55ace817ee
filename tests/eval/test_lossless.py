"""eval/lossless.py: the verdict on hand-made divergences and noise (fp32: any difference fails; bf16: a divergence
inside the measured noise is rounding, one beyond it fails, noise beyond bf16 rounding fails), and the measurements
on a tiny Llama: teacher forcing reproduces the decoders' logits, growing and static caches agree, a planted
divergence is found and judged."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.decoding import CacheMode, speculative_generate, target_generate
from specdistill.decoding.drafters import LMDrafter
from specdistill.eval.lossless import (NOISE_GUARD, DecodePath, Divergence, Noise, Spread, compare_decodings,
                                       first_divergences, fp32_margins, judge, measure_noise, plain_logits,
                                       teacher_forced_logits)
from tests.conftest import left_padded_prompts

VOCAB = 64
GROWING = CacheMode()


def spread(max_: float) -> Spread:
    return Spread(100, max_ / 2, max_ * 0.9, max_)


def noise(deviation: float, plain: float | None = None) -> Noise:
    plain = deviation if plain is None else plain
    return Noise(spread(deviation), spread(deviation / 2), spread(deviation), spread(plain), argmax_flips=3)


# ------------------------------------------------------------------------------------------------ the verdict
def test_first_divergences_finds_each_rows_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3], [9]]
    other = [[1, 2, 3, 4], [5, 0, 7], [1, 2, 3, 8], [7, 1]]
    got = first_divergences(ref, other)
    assert got == [Divergence(1, 1, 6, 0), Divergence(2, 3, None, 8), Divergence(3, 0, 9, 7)]
    assert first_divergences(ref, ref) == []
    with pytest.raises(ValueError, match="same rows"):
        first_divergences(ref, other[:2])


def test_fp32_any_difference_fails_however_small_its_margin():
    tiny = [Divergence(0, 5, 1, 2, fp32_margin=1e-9)]
    v = judge(4, tiny, exact=True)
    assert not v.ok and len(v.problems) == 1 and "token-identical" in v.problems[0]
    assert v.to_dict()["identical_rows"] == 3 and v.to_dict()["beyond_noise"] == 1
    assert judge(4, [], exact=True).ok


def test_bf16_divergence_inside_the_noise_is_rounding_and_beyond_it_fails():
    n = noise(0.3)  # bound = 2 x 0.3
    inside = Divergence(0, 7, 10, 11, fp32_margin=0.59)
    beyond = Divergence(1, 2, 10, 12, fp32_margin=0.61)
    v = judge(2, [inside], exact=False, noise=n)
    assert v.ok and v.judged[0].rounding and v.judged[0].noise_bound == pytest.approx(0.6)
    v = judge(2, [inside, beyond], exact=False, noise=n)
    assert not v.ok and [j.rounding for j in v.judged] == [True, False]
    assert len(v.problems) == 1 and "row 1 token 2" in v.problems[0] and "0.61" in v.problems[0]
    d = v.to_dict()
    assert d["rounding"] == 1 and d["beyond_noise"] == 1
    assert d["divergences"][1] == {"row": 1, "position": 2, "reference_token": 10, "other_token": 12,
                                   "fp32_margin": 0.61, "noise_bound": pytest.approx(0.6), "rounding": False}


def test_bf16_a_decoding_that_stops_early_is_no_rounding():
    v = judge(1, [Divergence(0, 3, None, 5)], exact=False, noise=noise(10.0))
    assert not v.ok and "ended" in v.problems[0]


def test_bf16_noise_beyond_a_plain_forwards_rounding_fails_even_without_divergences():
    assert judge(3, [], exact=False, noise=noise(0.3, plain=0.3 / NOISE_GUARD)).ok
    v = judge(3, [], exact=False, noise=noise(0.3, plain=0.3 / NOISE_GUARD / 1.01))
    assert not v.ok and "plain bf16 forward" in v.problems[0]


def test_bf16_verdict_needs_measured_noise():
    with pytest.raises(ValueError, match="noise"):
        judge(1, [], exact=False)


def test_spread_reads_its_values():
    s = Spread.of(torch.arange(1.0, 101.0))
    assert (s.positions, s.median, s.max) == (100, 50.0, 100.0) and 99.0 <= s.p99 <= 100.0
    with pytest.raises(ValueError):
        Spread.of(torch.empty(0))


# ------------------------------------------------------------------------------------------------ tiny-model runs
@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions: margins well above bf16 rounding at most positions
    return model


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([7, 3, 5, 6], seed=4, vocab=VOCAB)


def decode(model, ids, mask, cache=GROWING, n=12) -> list[list[int]]:
    r = target_generate(model, ids, mask, max_new_tokens=n, cache=cache)
    return [r.tokens(i) for i in range(ids.shape[0])]


def test_teacher_forcing_reproduces_the_decoders_logits(target, prompts):
    ids, mask = prompts
    tokens = torch.tensor(decode(target, ids, mask))                                     # (4, 12)
    for path in (DecodePath("growing"), DecodePath("static", CacheMode(static=True)), DecodePath("verify", chunk=5)):
        logits = teacher_forced_logits(target, ids, mask, tokens, path)
        M = 12 - 12 % path.chunk
        assert logits.shape == (4, M, VOCAB)
        assert torch.equal(logits.argmax(-1), tokens[:, :M])  # greedy: the logits argmax to the decoded tokens
        for r in range(4):
            plain = plain_logits(target, ids[r][mask[r].bool()], tokens[r, :M])
            torch.testing.assert_close(logits[r].float(), plain, atol=1e-4, rtol=1e-4)


def test_fp32_growing_static_and_speculative_decodings_pass(target, prompts):
    ids, mask = prompts
    growing = decode(target, ids, mask)
    r = speculative_generate(target, LMDrafter(target), ids, mask, strategy=3, max_new_tokens=12)
    for other in (decode(target, ids, mask, CacheMode(static=True)), [r.tokens(i) for i in range(4)]):
        v = compare_decodings(target, target, ids, mask, growing, other, exact=True)
        assert v.ok and v.rows == 4 and v.judged == [], v.problems


def test_fp32_planted_divergence_is_found_with_its_margin_and_fails(target, prompts):
    ids, mask = prompts
    growing = decode(target, ids, mask)
    other = copy.deepcopy(growing)
    other[2][6] = (other[2][6] + 1) % VOCAB
    v = compare_decodings(target, target, ids, mask, growing, other, exact=True)
    assert not v.ok and len(v.judged) == 1
    d = v.judged[0].divergence
    assert (d.row, d.position, d.reference_token, d.other_token) == (2, 6, growing[2][6], other[2][6])
    # the margin is the fp32 top-2 gap at that position, given the common prefix
    top2 = plain_logits(target, ids[2][mask[2].bool()], torch.tensor(growing[2][:7]))[6].topk(2).values
    assert d.fp32_margin == pytest.approx((top2[0] - top2[1]).item(), rel=1e-5) and d.fp32_margin > 0


def test_bf16_paths_noise_is_rounding_and_decides_divergences(target, prompts):
    ids, mask = prompts
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    growing = decode(bf16, ids, mask)
    paths = (DecodePath("growing"), DecodePath("static", CacheMode(static=True)))
    n = measure_noise(bf16, target, ids, mask, torch.tensor(growing), *paths)
    assert n.plausible and 0 < n.deviation and n.bound == 2 * n.deviation
    assert n.reference_vs_fp32.positions == 4 * 12 and n.between_paths.max <= 2 * n.deviation
    alone = measure_noise(bf16, target, ids, mask, torch.tensor(growing), *paths, rows_per_call=1)  # unpadded rows
    assert alone.plausible and alone.reference_vs_fp32.positions == 4 * 12
    assert alone.deviation == pytest.approx(n.deviation, rel=0.5)  # rounding of the same size, padded or not
    static = decode(bf16, ids, mask, CacheMode(static=True))
    v = compare_decodings(bf16, target, ids, mask, growing, static, exact=False, paths=paths)
    assert v.ok == all(j.rounding for j in v.judged) and v.noise is not None

    # a planted divergence where the fp32 margin is largest (far beyond bf16 rounding of peaked logits) fails
    margins = [fp32_margins(target, ids, mask, growing, [Divergence(r, j, growing[r][j], 0)])[0]
               for r in range(4) for j in range(12)]
    widest = max(margins, key=lambda d: d.fp32_margin)
    assert widest.fp32_margin > n.bound  # the premise: sharpened logits have such positions
    planted = copy.deepcopy(growing)
    planted[widest.row][widest.position] = (growing[widest.row][widest.position] + 1) % VOCAB
    v = compare_decodings(bf16, target, ids, mask, growing, planted, exact=False, paths=paths)
    assert not v.ok and any(f"row {widest.row} token {widest.position}" in p for p in v.problems)
