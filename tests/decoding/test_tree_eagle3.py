"""EAGLE-3 heads grow token trees: every fed node's logits equal the chain drafter's after the same drafts (tree
attention in the head hides siblings, g is the parent's output, positions by depth), and tree decoding is lossless."""

import pytest
import torch

import specdistill.drafts.eagle3.drafter as eagle3_drafter
from specdistill.decoding import Sampler, speculative_generate, target_generate
from specdistill.drafts.eagle3 import Eagle3Drafter
from specdistill.decoding.tree import TreeShape, grow
from tests.conftest import left_padded_prompts as _prompts
from tests.decoding.test_eagle3_drafter import _head, _target


class _Forced:
    """A greedy sampler whose first draws are given draft ids (B,) each, then argmax."""

    greedy = True

    def __init__(self, first: list[torch.Tensor]):
        self.first = list(first)

    def draw(self, logits):
        return (self.first.pop(0) if self.first else logits.argmax(-1)), None


def _started(target, head, ids, mask) -> Eagle3Drafter:
    drafter = Eagle3Drafter(head)
    drafter.start(ids, mask, target(ids[:, :-1], attention_mask=mask[:, :-1], output_hidden_states=True).hidden_states)
    return drafter


@torch.no_grad()
def test_every_fed_tree_node_sees_what_the_chain_would(monkeypatch):
    target = _target(sharpen=3.0)
    head = _head(target, 40)
    ids, mask = _prompts([7, 4, 9])
    fed = []  # (d, beams' draft-vocab path (B, k, d), logits (B, k, Vd))
    paths = {0: None}

    def recording_grow(shape, root_logits, feed, to_target):
        t2d = {int(to_target(torch.tensor(i))): i for i in range(root_logits.shape[-1])}

        def wrapped(tokens, visible, d, parent):
            draft_ids = tokens.clone().apply_(lambda t: t2d[t])                         # (B, k)
            before = paths[d - 1]
            path = draft_ids[..., None] if before is None else torch.cat(
                [before.gather(1, parent[..., None].expand(-1, -1, d - 1)), draft_ids[..., None]], dim=2)
            paths[d] = path
            logits = feed(tokens, visible, d, parent)
            fed.append((d, path, logits))
            return logits

        return grow(shape, root_logits, wrapped, to_target)

    monkeypatch.setattr(eagle3_drafter, "grow", recording_grow)
    _started(target, head, ids, mask).propose(TreeShape(3, 3), Sampler(0.0))
    assert [d for d, _, _ in fed] == [1, 2]
    for d, path, logits in fed:
        for i in range(path.shape[1]):
            chain = _started(target, head, ids, mask)
            chain.propose(TreeShape.chain(d + 1), _Forced([path[:, i, j] for j in range(d)]))
            torch.testing.assert_close(chain.logits[:, d], logits[:, i], atol=1e-5, rtol=0, msg=f"depth {d} beam {i}")
    assert bool((paths[1][:, 1:, 0] != paths[1][:, :1, 0]).all())  # the later beams do branch off the first


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eagle3_tree_decoding_is_lossless_on_a_left_padded_batch(temperature):
    target = _target(sharpen=3.0)
    head = _head(target, 40)
    ids, mask = _prompts([7, 4, 9])
    reference = target_generate(target, ids, mask, max_new_tokens=16)
    for shape in [TreeShape(3, 3), TreeShape(4, 3, nodes=6)]:
        r = speculative_generate(target, Eagle3Drafter(head), ids, mask, strategy=shape, max_new_tokens=16,
                                 temperature=temperature, generator=torch.Generator().manual_seed(0))
        assert r.num_new_tokens.tolist() == [16, 16, 16]
        if temperature == 0:
            assert torch.equal(r.sequences, reference.sequences), shape.name
