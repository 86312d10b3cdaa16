"""The decoder's last layer run for the sampled rows alone (``OutputRows``).

A step's final hidden states are used only at each sampling sequence's last new token, so
the last layer computes every row's K/V (later tokens attend to them) but attention, o_proj
and the MLP only for those rows. These cases check, for a random small Llama over a paged
cache, that the pruned forward returns what the full forward returns at those rows and
leaves the cache bit-identical, and that the batch builder asks for pruning exactly when
some row's output is unused.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.cpu import paged_decode as native_decode
from vlmd.models.llama import LlamaForCausalLM
from vlmd.runner.batch import build_batch
from vlmd.runner.request_state import RunnerRequestState
from vlmd.types import SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=101, max_position_embeddings=1024,
    )
    llama = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in llama.parameters():
            param.normal_(0, 0.08)
    return llama


def _step(seqs, seed=0):
    """``seqs``: (context, new tokens, samples) per sequence, decodes first. Returns the
    chunks (random block tables), the used rows with their chunks, random embeddings and
    the positions."""
    rng = random.Random(seed)
    pool = list(range(sum(-(-(start + count) // BLOCK) for start, count, _ in seqs) + 2))
    rng.shuffle(pool)
    chunks, used, positions, row = [], [], [], 0
    for start, count, samples in seqs:
        blocks = -(-(start + count) // BLOCK)
        chunks.append(SequenceChunk([pool.pop() for _ in range(blocks)], start, count))
        positions.extend(range(start, start + count))
        row += count
        if samples:
            used.append((row - 1, chunks[-1]))
    torch.manual_seed(seed)
    return chunks, used, torch.randn(row, 64), torch.tensor(positions)


def _caches(model, num_blocks, seed):
    generator = torch.Generator().manual_seed(seed)
    spec = model.kv_spec
    shape = (num_blocks * BLOCK, spec.num_kv_heads, spec.head_dim)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
            for _ in range(spec.num_layers)]


SEQUENCES = {
    # a decode, a chunk after context that samples, a first chunk that does not, a fresh prompt
    "mixed": [(37, 1, True), (30, 17, True), (0, 25, False), (0, 9, True)],
    "decodes_and_one_prompt": [(20, 1, True), (64, 1, True), (0, 40, True)],
    "chunks_after_long_context": [(700, 33, True), (300, 12, True)],
}


@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("case", sorted(SEQUENCES))
def test_pruned_last_layer_matches_the_full_forward(model, kernels, case):
    if kernels == "auto" and not native_decode.available():
        pytest.skip("no kernel library was built in this install")
    chunks, used, embeds, positions = _step(SEQUENCES[case])
    num_blocks = max(max(chunk.block_ids) for chunk in chunks) + 1
    backend = attention_backend_for("cpu", BLOCK, kernels)
    decodes = sum(1 for start, count, _ in SEQUENCES[case] if count == 1 and start > 0)
    outputs = backend.prepare_output_rows(used, embeds.shape[0])
    assert outputs is not None and outputs.rows.tolist() == [row for row, _ in used]
    full_cache, pruned_cache = _caches(model, num_blocks, 1), _caches(model, num_blocks, 1)
    with torch.inference_mode():
        full = model(embeds, positions, backend.prepare_metadata(chunks, decodes), full_cache)
        pruned = model(embeds, positions, backend.prepare_metadata(chunks, decodes), pruned_cache, outputs)
    assert pruned.shape == (len(used), 64)
    torch.testing.assert_close(pruned, full[outputs.rows], rtol=1e-4, atol=1e-5)
    for (full_k, full_v), (pruned_k, pruned_v) in zip(full_cache, pruned_cache):
        assert torch.equal(full_k, pruned_k) and torch.equal(full_v, pruned_v)


def test_a_step_that_samples_nothing_still_writes_every_row(model):
    """A prompt's first chunk: no output is used, yet the last layer's K/V must be cached."""
    chunks, used, embeds, positions = _step([(0, 30, False), (16, 20, False)])
    num_blocks = max(max(chunk.block_ids) for chunk in chunks) + 1
    backend = attention_backend_for("cpu", BLOCK, "torch")
    outputs = backend.prepare_output_rows(used, embeds.shape[0])
    assert outputs is not None and outputs.meta is None and outputs.rows.numel() == 0
    full_cache, pruned_cache = _caches(model, num_blocks, 2), _caches(model, num_blocks, 2)
    with torch.inference_mode():
        model(embeds, positions, backend.prepare_metadata(chunks, 0), full_cache)
        pruned = model(embeds, positions, backend.prepare_metadata(chunks, 0), pruned_cache, outputs)
    assert pruned.shape == (0, 64)
    for (full_k, full_v), (pruned_k, pruned_v) in zip(full_cache, pruned_cache):
        assert torch.equal(full_k, pruned_k) and torch.equal(full_v, pruned_v)


def test_nothing_is_pruned_when_every_row_is_used_or_a_prompt_is_one_token():
    backend = attention_backend_for("cpu", BLOCK, "torch")
    decodes = [SequenceChunk([3], 5, 1), SequenceChunk([4, 7], 20, 1)]
    assert backend.prepare_output_rows([(0, decodes[0]), (1, decodes[1])], 2) is None
    # A one-token prompt's row has no context to attend to as a decode.
    one_token, prompt = SequenceChunk([2], 0, 1), SequenceChunk([5, 6], 0, 20)
    assert backend.prepare_output_rows([(0, one_token), (20, prompt)], 21) is None


def _state(name, prompt, computed, blocks):
    return RunnerRequestState(
        request_id=name, token_ids=list(range(1, prompt + 1)), num_prompt_tokens=prompt, mm_items=[],
        sampling=SamplingParams(max_tokens=4), block_tables={0: blocks}, num_computed_tokens=computed, stop_token_ids=(),
    )


def test_the_batch_builder_prunes_to_the_sampled_rows():
    backend = attention_backend_for("cpu", BLOCK, "torch")
    decode = _state("decode", 10, 9, [0])  # its last prompt token left: one row that samples
    first_chunk = _state("chunked", 50, 0, [1, 2, 3, 4])  # 20 of 50 tokens: samples nothing
    whole = _state("whole", 12, 0, [5])
    batch = build_batch([(decode, 1), (first_chunk, 20), (whole, 12)], backend)
    assert batch.sample_rows == [0, 32]
    assert batch.outputs is not None and batch.outputs.rows.tolist() == [0, 32]
    assert batch.outputs.meta.num_decodes == 2
    # Decodes only: every row is used, so the last layer runs them all.
    only_decodes = build_batch([(decode, 1)], backend)
    assert only_decodes.outputs is None and only_decodes.sample_rows == [0]
