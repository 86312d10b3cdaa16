"""The families' checkpoint loading (vlmd/models/loader.py:load_multimodal_weights) refuses a
checkpoint with a weight missing, unknown or of the wrong shape, naming the family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from vlmd.models.loader import iterate_weights
from vlmd.plugins.manager import build_registry


def _model_and_weights(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    model_class = build_registry().for_architectures(list(config.architectures)).load("model")
    return model_class(config), list(iterate_weights(model_dir))


def _encoder_weight(weights) -> int:
    """The index of the first weight of the vision or audio tower."""
    return next(i for i, (name, _) in enumerate(weights) if any(k in name for k in ("vision", "visual", "audio")))


@pytest.mark.parametrize("fixture, family", [
    ("tiny_llava_dir", "LLaVA"), ("tiny_qwen2_vl_dir", "Qwen2-VL"), ("tiny_qwen2_audio_dir", "Qwen2-Audio"),
    ("tiny_qwen2_5_vl_dir", "Qwen2.5-VL"),
])
def test_bad_checkpoints_are_refused_by_name(request, fixture, family):
    model_dir = request.getfixturevalue(fixture)
    model, weights = _model_and_weights(model_dir)
    model.load_weights(weights)  # the checkpoint as built loads
    index = _encoder_weight(weights)
    name, tensor = weights[index]

    model, _ = _model_and_weights(model_dir)
    with pytest.raises(ValueError, match=f"{family} checkpoint lacks weights"):
        model.load_weights(weights[:index] + weights[index + 1:])
    model, _ = _model_and_weights(model_dir)
    with pytest.raises(ValueError, match="has shape"):
        model.load_weights(weights[:index] + [(name, torch.zeros(3, 1, 2))] + weights[index + 1:])
    model, _ = _model_and_weights(model_dir)
    junk = name.rsplit(".", 1)[0] + ".no_such_weight"
    with pytest.raises(ValueError, match=f"unexpected weight .* in {family} checkpoint"):
        model.load_weights(weights + [(junk, tensor)])


# The tiny checkpoints are written in one layout each; a family's table also names the other
# layout its published checkpoints use (transformers 5 saves under "model.", the 4.x -hf
# checkpoints do not). Renamed into that layout, the same tensors must load the same model.
def _transformers5(tower: str, its_prefix: str) -> tuple[tuple[str, str], ...]:
    """A 4.x -hf layout (the tiny checkpoints') -> transformers 5's, for a tower under ``tower``."""
    return (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
            (tower, its_prefix), ("multi_modal_projector.", "model.multi_modal_projector."))


# Qwen2-VL's and Qwen2.5-VL's tiny checkpoints are transformers 4.x's (model.* is the decoder).
_QWEN2_VL_TRANSFORMERS5 = (("model.", "model.language_model."), ("visual.", "model.visual."), ("lm_head.", "lm_head."))
OTHER_LAYOUT = {
    "tiny_llava_dir": _transformers5("vision_tower.", "model.vision_tower.vision_model."),
    "tiny_gemma3_dir": _transformers5("vision_tower.", "model.vision_tower.vision_model."),
    "tiny_internvl_dir": _transformers5("vision_tower.", "model.vision_tower."),
    "tiny_qwen2_audio_dir": _transformers5("audio_tower.", "model.audio_tower."),
    "tiny_mllama_dir": _transformers5("vision_model.", "model.vision_model."),
    "tiny_qwen2_vl_dir": _QWEN2_VL_TRANSFORMERS5,
    "tiny_qwen2_5_vl_dir": _QWEN2_VL_TRANSFORMERS5,
}


def _in_other_layout(name: str, renames) -> str:
    for tiny, other in renames:
        if name.startswith(tiny):
            return other + name[len(tiny):]
    raise AssertionError(f"{name!r}: no rename for it in the test's table")


@pytest.mark.parametrize("fixture", sorted(OTHER_LAYOUT))
def test_the_other_published_layout_loads_the_same_model(request, fixture):
    model_dir = request.getfixturevalue(fixture)
    model, weights = _model_and_weights(model_dir)
    model.load_weights(weights)
    other, _ = _model_and_weights(model_dir)
    renamed = [(_in_other_layout(name, OTHER_LAYOUT[fixture]), tensor) for name, tensor in weights]
    assert {name for name, _ in renamed} != {name for name, _ in weights}
    other.load_weights(renamed)
    expected, got = model.state_dict(), other.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)
