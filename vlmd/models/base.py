"""What the runner needs from a model family's model object."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

import torch

from vlmd.layers.attention import AttentionMetadata, LayerCache, OutputRows
from vlmd.types import KVSpec  # torch-free, so `vlmd cost` sizes caches without models

__all__ = ["CrossAttentionKV", "KVSpec", "ModelCapabilities", "MultimodalModel", "check_model_capabilities"]


class CrossAttentionKV(enum.Enum):
    """Where a decoder that cross-attends to encoder outputs gets a request's cross K/V;
    the value is the model method that computes them."""

    # ``prepare_cross_attention(encoder_output) -> [(K, V), ...]``: from the request's one
    # item (Whisper's audio window); every request carries it.
    FROM_ITEM = "prepare_cross_attention"
    # ``prepare_request_cross_attention(outputs, family_state) -> [(K, V), ...]``: from all
    # the request's items at once, laid out by the family state (Llama 3.2 Vision); a
    # request without items runs as text only, its rows skipping cross-attention.
    FROM_REQUEST_ITEMS = "prepare_request_cross_attention"


@dataclass(frozen=True)
class ModelCapabilities:
    """What a family's model offers beyond the required contract (:class:`MultimodalModel`).

    Each model class declares one as its class attribute ``capabilities``; a field that is
    True names a method the model must define, and the model may define no optional hook it
    does not declare (:func:`check_model_capabilities`, at load). The hooks:

    - ``slice_positions(family_state, start, end, num_prompt_tokens) -> [rows, end - start]
      int64 or None``: the positions of a request's tokens [start, end) where they are not
      plain ones (Qwen2-VL's 3-D table). ``family_state`` is the object the family's
      processor made for the request (``BaseMultiModalProcessor.family_state``), which the
      core carries without reading; None from this means plain positions for that slice.
    - ``attention_spans(items) -> [(first, end), ...]``: positions whose tokens attend to
      each other in both directions (an image's tokens, where the family's processing info
      says ``attends_within_items``); the runner hands each chunk the spans it reaches and
      the attention backend masks them (``layers/attention/masked.py``).
    - ``merge_multimodal(inputs_embeds, rows, features) -> Any``: where the encoder output
      is more than the placeholders' embeddings (e.g. wider: vectors for later layers too).
      ``rows`` ``[n]`` are the step's placeholder rows in the batch and ``features`` ``[n,
      width]`` their vectors, gathered from each item's stored encoder output for the part
      of the item this step computes (so chunking, the encoder cache, a prefix hit inside an
      item and preemption need nothing of the model). The model writes the embeddings
      itself; what it returns comes back to ``forward(..., multimodal=...)`` for this step.
      Without it the runner writes ``features`` into ``inputs_embeds[rows]``. (The width
      of those vectors is the processing info's ``encoder_output_width()``, which sizes the
      encoder cache.)
    - ``process_logits(logits, states) -> logits``: the model's own constraints on the next
      token (Whisper's timestamp rules), applied after the request's own constraints.
    - ``align_tokens(encoder_output, token_ids, first_row, num_frames) -> [rows, frames]``
      (numpy): how the output tokens fed after a prompt of ``first_row`` tokens attend to the
      audio's frames (word timestamps); the runner calls it on the engine thread between steps.
    - ``drop_encoders(modalities) -> list[str]``: frees the encoders of modalities limited
      to 0 before the model moves to the device, returning the modules it dropped; a model
      without it keeps its encoders.
    - ``cross_attention_kv``: the decoder cross-attends to encoder outputs (its items have
      no placeholders); the :class:`CrossAttentionKV` names the method that computes each
      cross-attention layer's K and V ``[kv_heads, tokens, head_dim]``, once per request; the
      runner writes them into the request's blocks of the cross-attention group
      (``runner/cross_cache.py``) and lets go of them. Its layers are ``kv_spec.num_cross_layers``
      (the spec's heads and head size, D93, D95); an item's cross tokens are what the family's
      processing info declares (``cross_kv_tokens_per_item``, the item's ``num_encoder_tokens``).
      Whether a prompt may come without items is the processing info's to say
      (``accepts_text_only_prompts``), not this. Such a model's ``forward`` takes
      ``cross_states=[(first row, end row, CrossSource or None), ...]``, one per request in
      batch order (its table in the cross-attention group, its encoder tokens, its family
      state; None without cross-attention items), and ``kv_caches`` holds the cross layers'
      caches after the self-attention ones (the KV model's order): a cross-attention layer
      calls ``cross_attention(q, its cache, meta, scale, spans)`` with a ``CrossSpan`` per
      request (``CrossSource.span``), and the attention backend reads the K/V and attends.
    - ``cross_attention_prefix_caching``: prefix caching stays on for this cross-attending
      model (it is off otherwise): block hashes name its items, and the first chunk after a
      hit derives the cross K/V again from every item before it; declare it once a second
      turn's ``cached_tokens`` is tested for the family.
    """

    slice_positions: bool = False
    attention_spans: bool = False
    merge_multimodal: bool = False
    process_logits: bool = False
    align_tokens: bool = False
    drop_encoders: bool = False
    cross_attention_kv: CrossAttentionKV | None = None
    cross_attention_prefix_caching: bool = False

    # The boolean fields, each the name of the method it promises.
    HOOKS: ClassVar[tuple[str, ...]] = (
        "slice_positions", "attention_spans", "merge_multimodal", "process_logits", "align_tokens", "drop_encoders",
    )

    def __post_init__(self):
        if self.cross_attention_prefix_caching and self.cross_attention_kv is None:
            raise ValueError("cross_attention_prefix_caching is declared without cross_attention_kv")

    @property
    def cross_attends(self) -> bool:
        """The decoder cross-attends to its requests' encoder outputs (Whisper, Llama 3.2 Vision)."""
        return self.cross_attention_kv is not None

    def declared_hooks(self) -> set[str]:
        """The optional methods this declaration promises."""
        hooks = {name for name, declared in asdict(self).items() if name in self.HOOKS and declared}
        if self.cross_attention_kv is not None:
            hooks.add(self.cross_attention_kv.value)
        return hooks


# Every optional method a model may define: one it defines without declaring is refused at
# load, so a forgotten declaration (or a misspelt method) fails at start-up, never ignored.
OPTIONAL_HOOKS = frozenset(ModelCapabilities.HOOKS) | {kind.value for kind in CrossAttentionKV}
# Attributes that once declared a capability by their presence, and what replaced them.
RETIRED_ATTRIBUTES = {
    "is_encoder_decoder": "capabilities.cross_attention_kv",
    "prefix_caching": "capabilities.cross_attention_prefix_caching",
}


def check_model_capabilities(family: str, model: Any) -> ModelCapabilities:
    """``model``'s declared capabilities (a model object or its class), after checking that
    it defines every optional hook it declares and none it does not. The one place that
    probes a model's attributes by name; everything else reads the declaration."""
    declaration = getattr(model, "capabilities", None)
    if not isinstance(declaration, ModelCapabilities):
        raise ValueError(f"{family}: the model class declares no `capabilities = ModelCapabilities(...)` "
                         "(vlmd/models/base.py)")
    declared = declaration.declared_hooks()
    missing = sorted(hook for hook in declared if not callable(getattr(model, hook, None)))
    if missing:
        raise ValueError(f"{family}: the model declares {missing} in its capabilities but does not define "
                         f"{'it' if len(missing) == 1 else 'them'}")
    undeclared = sorted(hook for hook in OPTIONAL_HOOKS - declared if hasattr(model, hook))
    if undeclared:
        raise ValueError(f"{family}: the model defines {undeclared} but does not declare "
                         f"{'it' if len(undeclared) == 1 else 'them'} in its capabilities (vlmd/models/base.py:"
                         "ModelCapabilities); the runner would never call an undeclared hook")
    retired = sorted(name for name in RETIRED_ATTRIBUTES if hasattr(model, name))
    if retired:
        raise ValueError(f"{family}: the model defines {retired}, which no longer declare anything: use "
                         + ", ".join(RETIRED_ATTRIBUTES[name] for name in retired))
    return declaration


class MultimodalModel(Protocol):
    """The contract between the runner and a family's model (an ``nn.Module``).

    - ``kv_spec``: the shape of the paged cache the decoder needs;
    - ``embed_input_ids``: token embeddings, placeholders included;
    - ``embed_multimodal``: encoder + projector for a batch of items of one modality,
      one ``[item.num_encoder_tokens, hidden]`` tensor per item;
    - ``forward``: the decoder over the paged cache, returning final hidden states: of
      every row, or given ``outputs`` (``OutputRows``, the rows the step samples) of those
      rows alone, in their order (a decoder may then run its last layer for them only);
    - ``compute_logits``: hidden states to vocabulary logits.

    Beyond these a model offers only what its class declares in ``capabilities``
    (:class:`ModelCapabilities`, where each optional hook is documented); the loader checks
    the declaration against the class when the model loads (:func:`check_model_capabilities`),
    and the runner, builder and sizing read the declaration, never the model's attributes.
    A decoder that cross-attends to encoder outputs (``ModelCapabilities.cross_attention_kv``)
    also takes ``forward(..., cross_states=[(first row, end row, CrossKV or None), ...])``,
    one per request in batch order: its K/V read through its table (``CrossKV.kv``, per
    layer) and its family state; None for a request without cross-attention items.
    """

    kv_spec: KVSpec
    capabilities: ClassVar[ModelCapabilities]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def embed_multimodal(self, modality: str, encoder_inputs: list[dict[str, Any]]) -> list[torch.Tensor]: ...

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerCache],  # per layer: its (K, V) pool tensors and its KV group
        outputs: OutputRows | None = None,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
