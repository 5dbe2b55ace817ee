"""What every draft kind shares about a reduced vocabulary and its saved folder: the id maps (models/vocab.py
DraftVocabMaps), the d2t checks (export.check_d2t) and the weights-and-config writer (export.write_weights)."""
import json

import pytest
import torch
from safetensors.torch import load_file

from specdistill.export import WEIGHTS_FILE, check_d2t, write_weights
from specdistill.models.vocab import DraftVocabMaps


class Maps(DraftVocabMaps, torch.nn.Module):
    def __init__(self, V, Vd):
        super().__init__()
        self.register_vocab_maps(V, Vd)


def test_set_vocab_maps_every_draft_id_onto_its_kept_target_id():
    m = Maps(10, 4)
    assert not m.t2d.any()  # a reduced vocabulary keeps nothing until set_vocab
    kept = torch.tensor([1, 4, 5, 9])
    m.set_vocab(kept)
    assert torch.equal(m.draft_to_target(torch.arange(4)), kept)
    assert m.t2d.nonzero().flatten().tolist() == kept.tolist()
    assert check_d2t(m.d2t, 10, "fix") == []
    full = Maps(6, 6)
    assert full.t2d.all() and torch.equal(full.draft_to_target(torch.arange(6)), torch.arange(6))


@pytest.mark.parametrize("d2t, problem", [
    (torch.tensor([1, 3, 3, 6], dtype=torch.int32), "dtype"),
    (torch.tensor([1, 3, 3, 7]), "outside the target vocab"),    # draft id 3 -> target id 10 of 10
    (torch.tensor([-2, 2, 2, 4]), "outside the target vocab"),   # draft id 0 -> target id -2
    (torch.tensor([1, 0, 3, 5]), "not strictly increasing"),     # target ids 1, 1, 5, 8
])
def test_check_d2t_names_each_problem_and_the_fix(d2t, problem):
    errs = check_d2t(d2t, 10, "rebuild it")
    assert len(errs) == 1 and problem in errs[0] and errs[0].endswith("rebuild it")


def test_write_weights_stores_tensors_that_share_storage(tmp_path):
    w = torch.randn(4, 3)
    write_weights(tmp_path, {"a": w, "b": w[:2], "c": w.t()}, {"x": 1})  # shared and non-contiguous
    sd = load_file(str(tmp_path / WEIGHTS_FILE))
    assert torch.equal(sd["a"], w) and torch.equal(sd["b"], w[:2]) and torch.equal(sd["c"], w.t())
    assert json.loads((tmp_path / "config.json").read_text()) == {"x": 1}
