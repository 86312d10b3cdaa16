"""The runner: owns the model, the KV tensors and the encoder outputs; runs one step."""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import torch

from vlmd.layers.attention import attention_backend_for
from vlmd.models.base import CrossAttentionKV, MultimodalModel
from vlmd.runner.batch import StepBatch, build_batch
from vlmd.runner.cross_cache import CrossCache, cross_states
from vlmd.runner.grammar_mask import advance_grammars
from vlmd.runner.host_staging import HostStaging
from vlmd.layers.linear_attention.state import commit_states
from vlmd.runner.kv_cache import allocate_kv_slots, copy_pages, layer_caches
from vlmd.runner.request_state import RunnerRequestState
from vlmd.runner.sampler import sample
from vlmd.sched.kv_spec import CrossAttention, KVCacheConfig
from vlmd.sched.output import RunnerOutput, SchedulerOutput
from vlmd.types import MultiModalItem


class ModelRunner:
    def __init__(
        self, model: MultimodalModel, kv_cache: KVCacheConfig, dtype: torch.dtype, seed: int = 0,
        device: torch.device | None = None, samples: bool = True, attention_kernels: str = "auto",
    ):
        """``kv_cache``: the KV model (the scheduler's: its pool's blocks and the layer groups
        sharing them, sched/kv_spec.py), whose layer slots this runner allocates.
        ``samples=False``: a tensor-parallel rank other than 0, which runs the forward
        (its collectives) but neither computes logits nor samples; it learns the tokens
        rank 0 sampled through :meth:`append_sampled` before the next step."""
        self.model = model
        self.samples = samples
        # The one device of this runner: weights, KV cache, encoder outputs, sampler state
        # and each step's tensors live there (default: where the weights are).
        self.device = device if device is not None else next(model.parameters()).device
        self.kv_config = kv_cache
        self.block_size = kv_cache.block_size
        # The backend for the runner's device reads the paged cache in place.
        self.attention = attention_backend_for(self.device.type, self.block_size, attention_kernels)
        spec = model.kv_spec
        # The pool's layer slots; every layer's cache is its slot's tensors and its group.
        self.kv_slots = allocate_kv_slots(spec, kv_cache, dtype, self.device)
        # Every layer of the KV model, in its order: the self-attention layers, then the
        # cross-attention ones (the model's forward gets them all).
        self.kv_caches = layer_caches(kv_cache, self.kv_slots, range(spec.num_layers + spec.num_cross_layers), spec)
        self.cross_cache = None
        cross_groups = kv_cache.groups_of(CrossAttention)
        if spec.num_cross_layers:
            if len(cross_groups) != 1:
                raise ValueError(f"{spec.num_cross_layers} cross-attention layers need one KV group of their own "
                                 f"(the KV model has {len(cross_groups)}): more cross than self-attention layers?")
            self.cross_cache = CrossCache(self.kv_caches[spec.num_layers:], self.block_size, cross_groups[0].index)
        self.staging = HostStaging(self.device)
        self.requests: dict[str, RunnerRequestState] = {}
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.num_encoder_forwards = 0
        self.num_encoder_calls = 0
        # What the model offers beyond the required contract, as its class declares it
        # (models/base.py:ModelCapabilities; checked when the model loaded). A hook the
        # model does not declare is None here.
        capabilities = model.capabilities
        # The model's positions for a request's tokens from its family state, where they
        # are not plain ones (Qwen2-VL's 3-D table).
        self.slice_positions = model.slice_positions if capabilities.slice_positions else None
        # Spans of a request's items whose tokens attend both ways (an image's, in some VLMs).
        self.attention_spans = model.attention_spans if capabilities.attention_spans else None
        # Where the model merges encoder outputs itself (a wider output than its embeddings,
        # read by later layers).
        self.merge_multimodal = model.merge_multimodal if capabilities.merge_multimodal else None
        # A decoder that cross-attends to several items and the family state at once
        # (docs/adding-a-family.md, step 5).
        from_request = capabilities.cross_attention_kv is CrossAttentionKV.FROM_REQUEST_ITEMS
        self.prepare_request_cross_attention = model.prepare_request_cross_attention if from_request else None
        # Either way, (encoder outputs, family state) -> each cross layer's K/V (cross_cache.py).
        self.prepare_cross = self.prepare_request_cross_attention or (
            lambda outputs, _family_state: model.prepare_cross_attention(outputs[-1]))
        self.cross_attends = capabilities.cross_attends
        # The model's own rule on the next token (Whisper's timestamps).
        self.process_logits = model.process_logits if capabilities.process_logits else None

    def apply_schedule(self, out: SchedulerOutput) -> None:
        """Take in the step's bookkeeping (new, resumed, dropped requests; new blocks; evicted
        encoder outputs). Exactly once per SchedulerOutput: it is not idempotent."""
        self._update_states(out)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, request_ids: list[str]) -> RunnerOutput:
        """Compute the scheduled chunks of ``request_ids`` (all of ``out``'s, or a subset).

        Safe to call again over the same chunks after it raised, which is how the engine
        finds the request that made a step fail: the KV slots of a chunk are rewritten with
        the same values (a chunk's K/V depend only on the request's own earlier tokens),
        encoder outputs already stored are reused, and a request's state (computed tokens,
        sampled token) advances only when the whole call succeeds.
        """
        started = time.perf_counter()
        self._run_encoders(out, request_ids)
        encoder_seconds = time.perf_counter() - started

        scheduled = [(self.requests[rid], out.num_scheduled_tokens[rid]) for rid in request_ids]
        batch = build_batch(scheduled, self.attention, self.slice_positions, self.attention_spans)
        if not self.staging.passthrough:
            input_ids, positions, meta, outputs = self.staging.to_device(
                (batch.input_ids, batch.positions, batch.meta, batch.outputs)
            )
            batch = dataclasses.replace(batch, input_ids=input_ids, positions=positions, meta=meta, outputs=outputs)
        embeds = self.model.embed_input_ids(batch.input_ids)
        extra = {}
        spans = encoder_spans(batch, self.encoder_outputs)
        if spans and self.merge_multimodal is not None:
            # The model places the rows itself and gets back what it made of them.
            rows, features = gather_spans(spans, self.device)
            extra["multimodal"] = self.merge_multimodal(embeds, rows, features)
        else:
            # Each span is a run of consecutive rows: write its slice of the stored output
            # in place (no gathered copy of every placeholder's features).
            for row, features in spans:
                embeds[row : row + len(features)] = features
        if self.cross_attends:
            extra["cross_states"] = cross_states(batch, self.cross_cache, self.encoder_outputs, self.prepare_cross,
                                                 self.prepare_request_cross_attention is None)
        # Given the sampled rows, the model returns only theirs (its last layer runs them alone).
        hidden = self.model.forward(embeds, batch.positions, batch.meta, self.kv_caches, outputs=batch.outputs, **extra)

        result = RunnerOutput(encoder_seconds=encoder_seconds)
        if batch.sample_rows and self.samples:
            sampled = hidden if batch.outputs is not None else hidden[batch.sample_rows]
            logits = self.model.compute_logits(sampled).float()
            tokens, logprobs = sample(logits, batch.sample_states, self.generator, self.process_logits)
            result.grammar_completed, result.grammar_rejected = advance_grammars(batch.sample_states, tokens)
            kept = [(state, token, logprob) for state, token, logprob in zip(batch.sample_states, tokens, logprobs)
                    if state.request_id not in result.grammar_rejected]  # those end with an error, tokenless
            for state, token, logprob in kept:
                result.sampled_token_ids[state.request_id] = token
                if logprob is not None:
                    result.logprobs[state.request_id] = logprob
            # Nothing below can raise: commit the states only now (the token, and its count
            # for a penalized request).
            for state, token, _ in kept:
                state.append_token(token)
        # The step ran: the linear-attention layers' new states are stored, then copied into
        # the snapshots the scheduler asked for at this chunk's end (D105).
        commit_states(batch.meta)
        for request_id in request_ids:
            for group, pages in out.state_snapshots.get(request_id, {}).items():
                table = self.requests[request_id].block_tables[group]
                copy_pages(self.kv_config, self.kv_slots, group, table[:len(pages)], pages)
        for piece in batch.slices:
            piece.state.num_computed_tokens = piece.end
        return result

    def append_sampled(self, sampled_token_ids: dict[str, int]) -> None:
        """The tokens another rank sampled in the previous step (a rank that does not sample)."""
        for request_id, token in sampled_token_ids.items():
            state = self.requests.get(request_id)
            if state is not None:
                state.append_token(token)

    def set_computed(self, num_computed_tokens: dict[str, int]) -> None:
        """Rank 0's view before a re-run of a failed step (its run may have failed after the
        forward, where this rank's succeeded and advanced)."""
        for request_id, count in num_computed_tokens.items():
            self.requests[request_id].num_computed_tokens = count

    def _update_states(self, out: SchedulerOutput) -> None:
        for request_id in out.dropped_request_ids:
            self.requests.pop(request_id, None)
        for identifier in out.evicted_encoder_identifiers:
            self.encoder_outputs.pop(identifier, None)
        for data in out.new_requests:
            state = self.requests[data.request_id] = RunnerRequestState.from_new(data)
            # A prefix hit of a model with recurrent state starts from a snapshot's copy.
            for group, pages in data.state_sources.items():
                copy_pages(self.kv_config, self.kv_slots, group, pages, state.block_tables[group][:len(pages)])
        for data in out.cached_requests:
            state = self.requests[data.request_id]
            for group, new_blocks in data.new_block_ids.items():
                state.block_tables[group].extend(new_blocks)
            state.num_computed_tokens = data.num_computed_tokens

    def _run_encoders(self, out: SchedulerOutput, request_ids: list[str]) -> None:
        """Encode the items these chunks need that have no stored output yet.

        Besides the items scheduled for encoding, an item this chunk reads that another
        request was to encode in the same step counts too: after a failed step is re-run
        without that request, the output would otherwise be missing.
        """
        pending: dict[str, dict[str, MultiModalItem]] = defaultdict(dict)
        for request_id in request_ids:
            state = self.requests[request_id]
            start = state.num_computed_tokens
            if start >= state.items_end and request_id not in out.scheduled_encoder_inputs:
                continue  # past every item (every decode after the prompt's): nothing to encode
            end = start + out.num_scheduled_tokens[request_id]
            scheduled = set(out.scheduled_encoder_inputs.get(request_id, ()))
            for index, item in enumerate(state.mm_items):
                needed = index in scheduled or (item.offset < end and item.use_end > start)
                if needed and item.identifier not in self.encoder_outputs:
                    pending[item.modality][item.identifier] = item
        for by_id in pending.values():
            local = []
            for item in by_id.values():
                if item.encoder_output is None:
                    local.append(item)
                    continue
                # Sent by an encoder server (--encoder-urls): stored as if encoded here. The
                # item lets go of it, so a request keeps no second copy beside the cache (an
                # eviction or a preemption later re-encodes it here, the same output).
                output, item.encoder_output = item.encoder_output, None
                self.encoder_outputs[item.identifier] = output.to(self.device)
            if local:
                self.encoder_outputs.update(zip((item.identifier for item in local), self.encode_items(local)))

    @torch.inference_mode()
    def encode_items(self, items: list[MultiModalItem]) -> list[torch.Tensor]:
        """The encoder outputs of ``items`` (one modality), one ``[num_encoder_tokens, width]``
        tensor each: the model's ``embed_multimodal`` over their encoder inputs, checked.
        An encoder-only server (``--encoder-only``) serves these, on the engine thread."""
        outputs = []
        for modality in dict.fromkeys(item.modality for item in items):
            group = [item for item in items if item.modality == modality]
            encoded = self.model.embed_multimodal(modality, [item.encoder_inputs for item in group])
            self.num_encoder_forwards += len(group)
            self.num_encoder_calls += 1
            for item, output in zip(group, encoded):
                if output.shape[0] != item.num_encoder_tokens:
                    raise RuntimeError(
                        f"{modality} encoder produced {output.shape[0]} vectors for an item "
                        f"of {item.num_encoder_tokens} encoder tokens"
                    )
            outputs.extend(zip(group, encoded))
        by_item = {id(item): output for item, output in outputs}
        return [by_item[id(item)] for item in items]

    @torch.inference_mode()
    def align_tokens(self, item: MultiModalItem, token_ids: list[int], first_row: int, num_frames: int):
        """The model's ``align_tokens`` over ``item``'s encoder output (kept from the decode
        if the encoder cache still holds it, else encoded again): word timestamps."""
        if not self.model.capabilities.align_tokens:
            raise RuntimeError("this model does not align output tokens to its input")
        output = self.encoder_outputs.get(item.identifier)
        if output is None:
            output = self.encode_items([item])[0]
        return self.model.align_tokens(output, token_ids, first_row, num_frames)


def encoder_spans(batch: StepBatch, encoder_outputs) -> list[tuple[int, torch.Tensor]]:
    """(first batch row, features ``[n, width]``) for each run of this step's placeholders:
    the slice of the item's stored encoder output that this chunk computes, whether the
    output was just encoded or kept from an earlier step. A view, never a copy."""
    spans: list[tuple[int, torch.Tensor]] = []
    for piece in batch.slices:
        if piece.start >= piece.state.items_end:
            continue  # past every item's placeholders
        for item in piece.state.mm_items:
            first = max(item.offset, piece.start)
            last = min(item.end, piece.end)
            if first >= last:
                continue
            output = encoder_outputs.get(item.identifier)
            if output is None:
                raise RuntimeError(f"encoder output for {item.modality} item {item.identifier[:12]} is missing")
            spans.append((piece.row + first - piece.start, output[first - item.offset : last - item.offset]))
    return spans


def gather_spans(spans: list[tuple[int, torch.Tensor]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows ``[n]``, features ``[n, width]``): the spans gathered, for a model that places
    them itself (``merge_multimodal``: its rows may be wider than the embeddings)."""
    rows = torch.cat([torch.arange(row, row + len(features)) for row, features in spans]).to(device)
    return rows, torch.cat([features for _, features in spans])
