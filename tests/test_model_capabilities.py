"""The model contract as declared capabilities (docs/decisions.md D99).

Each family's model class declares what it offers beyond the required contract
(``ModelCapabilities``); the loader checks the declaration against the model, so an
undeclared hook, a declared one the model lacks, or an attribute that used to declare a
capability by its presence fails at start-up with the family's name, not silently.

The built-in families are checked on their classes, without weights: every optional hook is
a method, which the class holds; ``load_model`` runs the same check on each loaded instance
(every family's server tests start through it, and one test below loads tiny LLaVA).
"""

from __future__ import annotations

import pytest
from torch import nn

from vlmd.models.base import OPTIONAL_HOOKS, CrossAttentionKV, ModelCapabilities, check_model_capabilities
from vlmd.plugins.manager import build_registry

FAMILIES = build_registry().families()


class _Base(nn.Module):
    def embed_input_ids(self, input_ids): ...
    def embed_multimodal(self, modality, encoder_inputs): ...
    def forward(self, inputs_embeds, positions, meta, kv_caches, outputs=None): ...
    def compute_logits(self, hidden): ...


def test_an_undeclared_hook_is_refused_naming_the_family_and_the_hook():
    class Model(_Base):
        capabilities = ModelCapabilities(drop_encoders=True)

        def drop_encoders(self, modalities):
            return []

        def slice_positions(self, family_state, start, end, num_prompt_tokens):
            return None

    with pytest.raises(ValueError, match=r"fam: the model defines \['slice_positions'\] but does not declare it"):
        check_model_capabilities("fam", Model())


def test_a_misspelt_hook_is_an_undeclared_one():
    class Model(_Base):  # declares align_tokens but misspells the method: the declared one is missing
        capabilities = ModelCapabilities(align_tokens=True)

        def align_token(self, encoder_output, token_ids, first_row, num_frames): ...

    with pytest.raises(ValueError, match=r"fam: the model declares \['align_tokens'\] in its capabilities but "
                                         r"does not define it"):
        check_model_capabilities("fam", Model)


def test_a_declared_hook_the_model_lacks_is_refused():
    class Model(_Base):
        capabilities = ModelCapabilities(merge_multimodal=True, cross_attention_kv=CrossAttentionKV.FROM_ITEM)

    with pytest.raises(ValueError, match=r"fam: the model declares \['merge_multimodal', 'prepare_cross_attention'\] "
                                         r"in its capabilities but does not define them"):
        check_model_capabilities("fam", Model())


def test_the_cross_attention_kind_names_which_method_must_exist():
    class Model(_Base):
        capabilities = ModelCapabilities(cross_attention_kv=CrossAttentionKV.FROM_REQUEST_ITEMS)

        def prepare_cross_attention(self, encoder_output): ...

    with pytest.raises(ValueError, match=r"declares \['prepare_request_cross_attention'\]"):
        check_model_capabilities("fam", Model())


def test_the_old_attributes_that_declared_by_presence_are_refused():
    class Model(_Base):
        capabilities = ModelCapabilities()
        is_encoder_decoder = True

    with pytest.raises(ValueError, match=r"fam: the model defines \['is_encoder_decoder'\].*capabilities\."
                                         r"cross_attention_kv"):
        check_model_capabilities("fam", Model())


def test_a_model_without_a_declaration_is_refused():
    with pytest.raises(ValueError, match=r"fam: the model class declares no `capabilities"):
        check_model_capabilities("fam", _Base())


def test_prefix_caching_for_cross_attention_needs_cross_attention():
    with pytest.raises(ValueError, match="cross_attention_prefix_caching is declared without cross_attention_kv"):
        ModelCapabilities(cross_attention_prefix_caching=True)


@pytest.mark.parametrize("family", FAMILIES, ids=[family.name for family in FAMILIES])
def test_every_built_in_family_declares_exactly_the_hooks_it_defines(family):
    model_class = family.load("model")
    capabilities = check_model_capabilities(family.name, model_class)
    defined = {hook for hook in OPTIONAL_HOOKS if callable(getattr(model_class, hook, None))}
    assert defined == capabilities.declared_hooks()


def test_the_two_meanings_of_encoder_decoder_are_apart():
    """Whisper and Llama 3.2 Vision both cross-attend; only Whisper's prompts need an item
    (Llama 3.2 Vision serves text-only chats), which its processing info says."""
    by_name = {family.name: family for family in FAMILIES}
    cross = {name for name, family in by_name.items() if family.load("model").capabilities.cross_attends}
    assert cross == {"whisper", "mllama"}
    needs_items = set()
    for name, family in by_name.items():
        info_class = family.load("processing_info")
        # The answer is a fact of the family, not of a checkpoint: asked of an info not
        # constructed (no checkpoint files to read).
        if not info_class.accepts_text_only_prompts(object.__new__(info_class)):
            needs_items.add(name)
    assert needs_items == {"whisper"}


def test_disabling_the_encoder_of_a_model_whose_prompts_need_one_is_refused():
    from vlmd.engine.sizing import drop_unused_encoders

    class Model(_Base):
        capabilities = ModelCapabilities()

    with pytest.raises(ValueError, match=r"disables \['audio'\], but this model needs an item"):
        drop_unused_encoders(Model(), {"audio": 1}, [], accepts_text_only_prompts=False)
    assert drop_unused_encoders(Model(), {"audio": 1}, [], accepts_text_only_prompts=True) == []


def test_load_model_checks_the_declaration(tiny_llava_dir, monkeypatch):
    """The check runs on the loaded model: an undeclared hook stops the start."""
    import torch

    from vlmd.engine.builder import load_model
    from vlmd_llava.model import LlavaModel

    monkeypatch.setattr(LlavaModel, "process_logits", lambda self, logits, states: logits, raising=False)
    with pytest.raises(ValueError, match=r"llava: the model defines \['process_logits'\] but does not declare it"):
        load_model(str(tiny_llava_dir), torch.float32)
