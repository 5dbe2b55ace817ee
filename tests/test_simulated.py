"""The simulated acceptance length: chain counts against a brute-force reference."""
import torch

from specdistill.eval.simulated import chain_counts, summarize


def _brute(match, valid, gamma):
    B, T = match.shape
    lengths = []
    for b in range(B):
        for t in range(T):
            if not valid[b, t]:
                continue
            n = 0
            while n < gamma and t + n < T and valid[b, t + n] and match[b, t + n]:
                n += 1
            lengths.append(n)
    return lengths


def test_chain_counts_match_brute_force():
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        match = torch.rand(3, 17, generator=g) < 0.7
        valid = torch.rand(3, 17, generator=g) < 0.8
        gamma = 1 + trial % 6
        lengths = torch.tensor(_brute(match, valid, gamma))
        reached = chain_counts(match, valid, gamma)
        assert reached[0] == len(lengths)
        for k in range(1, gamma + 1):
            assert reached[k] == (lengths >= k).sum(), (trial, k)
        s = summarize(reached, gamma)
        assert abs(s.mean_accept_len - (1 + lengths.float().mean().item())) < 1e-6


def test_extremes():
    valid = torch.ones(2, 10, dtype=torch.bool)
    s = summarize(chain_counts(torch.zeros_like(valid), valid, 4), 4)
    assert s.mean_accept_len == 1.0 and s.accept_rate_per_pos == [0.0, 0.0, 0.0, 0.0]
    s = summarize(chain_counts(torch.ones_like(valid), valid, 4), 4)
    # chains near the end of a row are cut by the row's end, as at the end of a sequence
    assert s.accept_rate_per_pos[0] == 1.0 and 1 + 4 * 0.7 <= s.mean_accept_len <= 5.0
