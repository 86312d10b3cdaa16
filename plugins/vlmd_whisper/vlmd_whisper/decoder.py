"""Our Whisper decoder: self-attention over the paged KV cache, cross-attention to the audio.

Pre-LayerNorm blocks (self-attention, cross-attention, GELU MLP), learned positions added to
the token embeddings, a final LayerNorm and the output projection tied to the token
embeddings. Self-attention K/V live in the paged cache like any decoder's. Cross-attention
K/V depend only on the request's encoder output: :meth:`WhisperDecoder.cross_attention_state`
computes them once per request (every layer), the runner writes them into the request's blocks
of the cross-attention KV group (``vlmd/runner/cross_cache.py``) and hands back each step
``cross_states``: ``(first row, end row, CrossSource)`` per request in the flattened batch, and
the cross-attention layers' caches after the self-attention ones in ``kv_caches``. The
attention backend reads each request's K/V through its table and attends
(``vlmd.layers.attention.cross_attention``): model code names rows, never kernels.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vlmd.layers.attention import AttentionMetadata, CrossSpan, OutputRows, cross_attention, paged_attention
from vlmd.layers.linear import (
    SINGLE,
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from vlmd.models.base import KVSpec
from vlmd.models.loader import load_into

CrossState = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V as [heads, frames, head_dim]


class WhisperSelfAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.head_dim = d_model // num_heads
        # Q, K, V in one matmul (this rank's heads); K has no bias in Whisper, so its bias
        # slot keeps the zeros it starts with.
        self.qkv_proj = QKVParallelLinear(d_model, self.head_dim, num_heads, num_heads, bias=True, tp=tp)
        self.num_heads = self.qkv_proj.num_heads
        self.out_proj = RowParallelLinear(d_model, d_model, bias=True, tp=tp)
        self.scale = self.head_dim**-0.5

    def forward(self, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        attended = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.out_proj(attended.reshape(tokens, -1))


class WhisperCrossAttention(nn.Module):
    def __init__(self, d_model: int, num_heads: int, tp: TPGroup = SINGLE):
        super().__init__()
        self.head_dim = d_model // num_heads
        self.num_heads = tp.split(num_heads, "decoder attention heads")
        self.q_proj = ColumnParallelLinear(d_model, d_model, bias=True, tp=tp)
        # K (no bias: its slot keeps its zeros) and V of this rank's heads.
        self.kv_proj = MergedColumnParallelLinear(d_model, [d_model, d_model], bias=True, tp=tp)
        self.out_proj = RowParallelLinear(d_model, d_model, bias=True, tp=tp)
        self.scale = self.head_dim**-0.5

    def memory(self, encoder_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one request's encoder output ``[frames, d_model]``."""
        frames = encoder_output.shape[0]
        kv = self.kv_proj(encoder_output).view(frames, 2, self.num_heads, self.head_dim)
        k, v = kv.permute(1, 2, 0, 3).unbind(0)  # each [heads, frames, head_dim]
        return k, v

    def forward(self, hidden: torch.Tensor, kv_cache, meta: AttentionMetadata, spans: list[CrossSpan]) -> torch.Tensor:
        tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(tokens, self.num_heads, self.head_dim)
        out = cross_attention(q, kv_cache, meta, self.scale, spans)
        return self.out_proj(out.reshape(tokens, -1))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, d_model: int, num_heads: int, ffn_dim: int, eps: float = 1e-5, tp: TPGroup = SINGLE):
        super().__init__()
        self.self_attn_layer_norm = nn.LayerNorm(d_model, eps=eps)
        self.self_attn = WhisperSelfAttention(d_model, num_heads, tp)
        self.encoder_attn_layer_norm = nn.LayerNorm(d_model, eps=eps)
        self.encoder_attn = WhisperCrossAttention(d_model, num_heads, tp)
        self.final_layer_norm = nn.LayerNorm(d_model, eps=eps)
        self.fc1 = ColumnParallelLinear(d_model, ffn_dim, bias=True, tp=tp)
        self.fc2 = RowParallelLinear(ffn_dim, d_model, bias=True, tp=tp)

    def forward(self, hidden, kv_cache, cross_cache, meta, spans) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), kv_cache, meta)
        hidden = hidden + self.encoder_attn(self.encoder_attn_layer_norm(hidden), cross_cache, meta, spans)
        return hidden + self.fc2(F.gelu(self.fc1(self.final_layer_norm(hidden))))


class WhisperDecoder(nn.Module):
    """Built from a transformers ``WhisperConfig``; weights named ``model.decoder.*``.

    Under tensor parallelism (``tp``) every attention and MLP is split by heads / columns
    (one all-reduce after each out_proj and fc2); embeddings, norms and the output
    projection are whole on every rank."""

    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        if getattr(config, "activation_function", "gelu") != "gelu":
            raise ValueError(f"Whisper activation {config.activation_function!r} is not supported (gelu is)")
        d_model, heads = config.d_model, config.decoder_attention_heads
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of decoder_attention_heads {heads}")
        self.embed_tokens = nn.Embedding(config.vocab_size, d_model)
        self.embed_positions = nn.Embedding(config.max_target_positions, d_model)
        self.layers = nn.ModuleList(
            WhisperDecoderLayer(d_model, heads, config.decoder_ffn_dim, tp=tp) for _ in range(config.decoder_layers)
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=1e-5)
        self.tied = bool(getattr(config, "tie_word_embeddings", True))
        # On the linear seam, so kernel selection covers it: at 51,864 x 384 it is the largest
        # product of a decode step (plain F.linear streamed it at ~9.5 GB/s, 8.4 ms of a 19 ms
        # step). Tied, it holds the token embeddings' own tensor (selection keeps that plain
        # copy for the lookups beside any packed one).
        self.proj_out = ReplicatedLinear(d_model, config.vocab_size, bias=False)
        if self.tied:
            self.proj_out.weight = self.embed_tokens.weight
        # Every layer cross-attends, with the self-attention's heads: their K/V are the cross pool's.
        self.kv_spec = KVSpec(num_layers=config.decoder_layers, num_kv_heads=self.layers[0].self_attn.num_heads,
                              head_dim=d_model // heads, num_cross_layers=config.decoder_layers)

    def cross_attention_state(self, encoder_output: torch.Tensor) -> CrossState:
        return [layer.encoder_attn.memory(encoder_output) for layer in self.layers]

    def forward(self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches, cross_states,
                outputs: OutputRows | None = None) -> torch.Tensor:
        """Every row's final hidden states, or with ``outputs`` its rows'. Every layer runs
        every row: a transcription's prompt is a few tokens, so pruning the last layer to
        the used rows (and its cross-attention spans with them) would save next to nothing."""
        hidden = inputs_embeds + self.embed_positions(positions)
        # Every request's rows attend to its audio, the same rows in every layer; the
        # cross-attention layers' caches follow the self-attention ones (the KV model's order).
        spans = [cross.span(start, end) for start, end, cross in cross_states]
        layers = len(self.layers)
        for layer, kv_cache, cross_cache in zip(self.layers, kv_caches[:layers], kv_caches[layers:]):
            hidden = layer(hidden, kv_cache, cross_cache, meta, spans)
        if outputs is not None:
            hidden = hidden[outputs.rows]
        return self.layer_norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj_out(hidden)

    def expected_weights(self) -> set[str]:
        """Checkpoint names a complete decoder has (the key-bias slots have none)."""
        names = set()
        for name, _ in self.named_parameters():
            if name == "proj_out.weight":
                names.add(name)
                continue
            for fused, parts in ((".qkv_proj.", ("q_proj", "k_proj", "v_proj")), (".kv_proj.", ("k_proj", "v_proj"))):
                if fused in name:
                    suffix = name.rsplit(".", 1)[1]
                    names.update(
                        "model.decoder." + name.replace(fused, f".{part}.") for part in parts
                        if not (part == "k_proj" and suffix == "bias")
                    )
                    break
            else:
                names.add("model.decoder." + name)
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``model.decoder.*`` (and an untied ``proj_out.weight``); returns what was filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "proj_out.weight":
                if self.tied:
                    continue  # tied: the same values as the token embeddings
                target, shard = "proj_out.weight", None
            else:
                target, shard = _our_name(name.removeprefix("model.decoder."))
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in Whisper checkpoint")
            load_into(param, tensor, name, shard)
            loaded.add(name)
        return loaded


def _our_name(name: str) -> tuple[str, str | int | None]:
    """A checkpoint name -> (our parameter, shard id of a fused projection's weight_loader)."""
    for attention, fused, parts in (
        ("self_attn", "qkv_proj", (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"))),
        ("encoder_attn", "kv_proj", (("k_proj", 0), ("v_proj", 1))),
    ):
        for part, shard in parts:
            fragment = f".{attention}.{part}."
            if fragment in name:
                return name.replace(fragment, f".{attention}.{fused}."), shard
    return name, None
