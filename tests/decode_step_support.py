"""What the fused decode step's tests share: decode chunks over random block tables, random
paged caches, and one step run fused or through the modules, counting native step calls."""

from __future__ import annotations

import random

import torch

from vlmd.layers.attention import SequenceChunk, attention_backend_for
from vlmd.layers.cpu import decoder_step
from vlmd.layers.cpu.fused_step import FusedDecodeSteps

BLOCK = 16


def decode_chunks(contexts, shared_blocks=0, seed=0, blocks=400):
    """Decode chunks with random block tables (ids below ``blocks``); the first
    ``shared_blocks`` blocks common to all."""
    rng = random.Random(seed)
    pool = list(range(1, blocks))
    rng.shuffle(pool)
    prefix = [pool.pop() for _ in range(shared_blocks)]
    return [SequenceChunk(prefix + [pool.pop() for _ in range(-(-(context + 1) // BLOCK) - shared_blocks)], context, 1)
            for context in contexts]


def random_caches(kv_spec, dtype=torch.float32, seed=1, blocks=400):
    """One (K, V) pair of ``blocks`` blocks per layer, random values of ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    shape = (blocks * BLOCK, kv_spec.num_kv_heads, kv_spec.head_dim)
    return [tuple(torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
            for _ in range(kv_spec.num_layers)]


def run_step(decoder, embeds, positions, chunks, caches, fused: bool, monkeypatch):
    """(``decoder``'s output for one step of ``chunks``, native step calls), through the
    fused step where it engages (``fused``) or through the modules."""
    calls = []
    real = decoder_step.NativeDecoder.__call__
    monkeypatch.setattr(decoder_step.NativeDecoder, "__call__", lambda self, *a: calls.append(1) or real(self, *a))
    if not fused:
        monkeypatch.setattr(FusedDecodeSteps, "run", lambda *a: None)
    backend = attention_backend_for("cpu", BLOCK, "auto")
    with torch.inference_mode():
        out = decoder(embeds, positions, backend.prepare_metadata(chunks, len(chunks)), caches)
    monkeypatch.undo()
    return out, len(calls)
