"""What the runner needs from a model family's model object."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from vlmd.layers.attention import AttentionMetadata, LayerCache, OutputRows
from vlmd.types import KVSpec  # torch-free, so `vlmd cost` sizes caches without models

__all__ = ["KVSpec", "MultimodalModel"]


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

    Optional, for encoder-decoder models (Whisper), whose items have no placeholders:
    - ``is_encoder_decoder = True``;
    - ``kv_spec.num_cross_layers``: its cross-attention layers, whose K/V (the spec's heads
      and head size) live in the blocks of their KV group (docs/decisions.md D93, D95);
    - ``prepare_cross_attention(encoder_output) -> [(K, V), ...]``: every cross-attention
      layer's K and V ``[kv_heads, tokens, head_dim]``, computed once per request; the runner
      writes them into the request's cross blocks (``runner/cross_cache.py``) and lets go of
      them; their tokens per item are what the family's processing info declares
      (``cross_kv_tokens_per_item``, the item's ``num_encoder_tokens``: what the scheduler takes);
      ``prepare_request_cross_attention(outputs, family_state)`` instead where several items
      of a request are attended to together (Llama 3.2 Vision);
    - ``forward(..., cross_states=[(first row, end row, CrossSource or None), ...])``, one
      per request in batch order: its table in the cross-attention KV group, its encoder
      tokens and its family state (``runner/cross_cache.py``); None for a request without
      cross-attention items. ``kv_caches`` then holds the cross-attention layers' caches after
      the self-attention ones (the KV model's layer order), and a cross-attention layer calls
      ``cross_attention(q, its cache, meta, scale, spans)`` with a ``CrossSpan`` per request
      (``CrossSource.span``: its rows, and a mask where not every row sees every token): the
      attention backend reads the K/V through the table and attends.
    - ``align_tokens(encoder_output, token_ids, first_row, num_frames) -> [rows, frames]``
      (numpy): how the output tokens fed after a prompt of ``first_row`` tokens attend to the
      audio's frames (word timestamps); the runner calls it on the engine thread between steps.
    Optional for any model:
    - ``process_logits(logits, states) -> logits``: the model's own constraints on the next
      token (Whisper's timestamp rules), applied after the request's own constraints;
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
    """

    kv_spec: KVSpec

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
