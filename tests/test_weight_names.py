"""A family's checkpoint-name table (vlmd/models/loader.py: ``WeightNames``) and the core loader
that applies it (``load_multimodal_weights``): first match wins, ``SKIP`` drops a tensor, a
name no row matches is an error naming it and the family, and a table whose order hides a
row is refused when it is made. The families' own tables are checked by their parity tests
(every tensor of their tiny checkpoints loads) and tests/test_weight_loading.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vlmd.models.loader import SKIP, WeightNames, load_multimodal_weights

NAMES = WeightNames("Toy", (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.language_model.", "language_model.model."),
    ("model.mtp.", SKIP),
    ("lm_head.", "language_model.lm_head."),
))


def test_the_first_matching_row_wins():
    # Both vision rows start this name; the first (longer) one applies.
    assert NAMES.target("model.vision_tower.vision_model.encoder.w") == "vision_tower.encoder.w"
    assert NAMES.target("model.vision_tower.head.w") == "vision_tower.head.w"
    assert NAMES.target("model.language_model.layers.0.w") == "language_model.model.layers.0.w"
    assert NAMES.target("lm_head.weight") == "language_model.lm_head.weight"


def test_a_skip_row_drops_the_tensor():
    assert NAMES.target("model.mtp.layers.0.w") is None
    assert repr(SKIP) == "SKIP"


def test_an_unmapped_name_is_an_error_naming_it_and_the_family():
    with pytest.raises(ValueError, match=r"unexpected weight 'model.audio_tower.w' in Toy checkpoint"):
        NAMES.target("model.audio_tower.w")
    # A prefix must match at its start, not anywhere in the name.
    with pytest.raises(ValueError, match="'x.lm_head.weight'"):
        NAMES.target("x.lm_head.weight")


def test_a_row_an_earlier_row_hides_is_refused_when_the_table_is_made():
    with pytest.raises(ValueError, match=r"'model.visual.' comes after 'model.'"):
        WeightNames("Toy", (("model.", "language_model.model."), ("model.visual.", "visual.")))
    with pytest.raises(ValueError, match="empty checkpoint prefix"):
        WeightNames("Toy", (("", "language_model."),))
    with pytest.raises(ValueError, match="not a .prefix, prefix or SKIP. row"):
        WeightNames("Toy", (("model.", None),))
    with pytest.raises(ValueError, match="not a .prefix, prefix or SKIP. row"):
        WeightNames("Toy", (("model.", "a.", "b."),))


class _TextModel(nn.Module):
    """The smallest language model the loader hands its ``language_model.*`` tensors to."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Parameter(torch.zeros(2))

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:  # the table's "language_model.model." -> "model."
            dict(self.named_parameters())[name.removeprefix("model.")].data.copy_(tensor)
            loaded.add(name.removeprefix("model."))
        return loaded


def _load(weights, not_built=None):
    tower = nn.Linear(2, 1, bias=False)
    text = _TextModel()
    params = {f"vision_tower.{name}": p for name, p in tower.named_parameters()}
    load_multimodal_weights(weights, NAMES, params, text, not_built=not_built)
    return tower, text


def test_the_loader_applies_the_table_and_skips_skip_rows():
    tower, text = _load([
        ("model.vision_tower.vision_model.weight", torch.tensor([[1.0, 2.0]])),
        ("model.language_model.embed", torch.tensor([3.0, 4.0])),
        ("model.mtp.anything", torch.zeros(7)),  # no parameter of that name: SKIP keeps it out
    ])
    assert tower.weight.tolist() == [[1.0, 2.0]] and text.embed.tolist() == [3.0, 4.0]


def test_the_loader_names_the_family_for_unknown_and_missing_weights():
    with pytest.raises(ValueError, match=r"unexpected weight 'model.vision_tower.bias' in Toy checkpoint"):
        _load([("model.vision_tower.weight", torch.zeros(1, 2)), ("model.vision_tower.bias", torch.zeros(1)),
               ("model.language_model.embed", torch.zeros(2))])
    with pytest.raises(ValueError, match=r"Toy checkpoint lacks weights, e.g. \['vision_tower.weight'\]"):
        _load([("model.language_model.embed", torch.zeros(2))])
    # What the configuration does not build is neither loaded nor expected.
    _load([("model.language_model.embed", torch.zeros(2)), ("model.vision_tower.weight", torch.zeros(9))],
          not_built=lambda target: target == "vision_tower.weight")
