"""Which audio frames each output token attends to: the alignment heads' cross-attention.

Some of Whisper's cross-attention heads follow the speech closely; a checkpoint names them in
``generation_config.json`` (``alignment_heads``: [layer, head] pairs). For word timestamps a
window's decoded tokens are fed once more, teacher-forced, through the decoder in plain torch
(causal self-attention over the tokens themselves, no paged cache): one pass per window after
its decode, not one per token, and only up to the last layer that holds an alignment head.
The weights of those heads are then treated as openai-whisper and transformers treat them:
cropped to the frames the audio covers, standardised over the tokens per head, median-filtered
over time and averaged over the heads. The dynamic time warping and the words are
``word_timing.py``'s (numpy, on the preprocessing pool).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

DEFAULT_MEDIAN_FILTER_WIDTH = 7  # openai-whisper's and transformers' WhisperConfig default


def alignment_heads(generation: dict, num_layers: int, num_heads: int) -> tuple[tuple[int, int], ...]:
    """The checkpoint's (layer, head) pairs, checked against the decoder's shape; () if none."""
    pairs = generation.get("alignment_heads") or ()
    heads = []
    for pair in pairs:
        if len(pair) != 2 or not all(isinstance(value, int) for value in pair):
            raise ValueError(f"alignment_heads must be [layer, head] pairs of integers, got {pair!r}")
        layer, head = pair
        if not (0 <= layer < num_layers and 0 <= head < num_heads):
            raise ValueError(f"alignment head {pair!r} is outside the decoder ({num_layers} layers x {num_heads} heads)")
        heads.append((layer, head))
    return tuple(heads)


def median_filter(values: torch.Tensor, width: int) -> torch.Tensor:
    """A running median of odd ``width`` along the last dimension, edges reflected."""
    if width <= 0 or width % 2 != 1:
        raise ValueError("the median filter width must be a positive odd number")
    pad = width // 2
    if values.shape[-1] <= pad:
        return values  # too short to reflect: left as it is (as the references do)
    flat = values.reshape(1, -1, values.shape[-1])  # reflect padding wants [batch, channels, time]
    padded = F.pad(flat, (pad, pad), mode="reflect").reshape(*values.shape[:-1], -1)
    return padded.unfold(-1, width, 1).sort(dim=-1).values[..., pad]


def cross_attention_weights(decoder, encoder_output: torch.Tensor, token_ids: list[int],
                            heads: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """``[len(heads), len(token_ids), frames]`` float32 attention probabilities of the named
    heads when ``token_ids`` are fed to ``decoder`` (a ``WhisperDecoder``) from position 0."""
    device = decoder.embed_tokens.weight.device
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(len(token_ids), device=device)
    hidden = decoder.embed_tokens(ids) + decoder.embed_positions(positions)
    memory = encoder_output.to(device, hidden.dtype)
    wanted: dict[int, list[int]] = {}
    for layer, head in heads:
        wanted.setdefault(layer, []).append(head)
    found: dict[tuple[int, int], torch.Tensor] = {}
    for index, layer in enumerate(decoder.layers[: max(wanted) + 1]):
        hidden = hidden + _self_attention(layer.self_attn, layer.self_attn_layer_norm(hidden))
        cross = layer.encoder_attn
        queries = cross.q_proj(layer.encoder_attn_layer_norm(hidden))
        queries = queries.view(len(token_ids), cross.num_heads, cross.head_dim).transpose(0, 1)
        keys, values = cross.memory(memory)  # each [heads, frames, head_dim]
        scores = torch.matmul(queries.float(), keys.float().transpose(-1, -2)) * cross.scale
        probs = scores.softmax(dim=-1)  # [heads, tokens, frames]
        for head in wanted.get(index, ()):
            found[(index, head)] = probs[head]
        if index == max(wanted):
            break
        attended = torch.matmul(probs.to(values.dtype), values).transpose(0, 1).reshape(len(token_ids), -1)
        hidden = hidden + cross.out_proj(attended)
        hidden = hidden + layer.fc2(F.gelu(layer.fc1(layer.final_layer_norm(hidden))))
    return torch.stack([found[pair] for pair in heads])


def _self_attention(attention, hidden: torch.Tensor) -> torch.Tensor:
    tokens = hidden.shape[0]
    q, k, v = attention.qkv_proj(hidden).view(tokens, 3, attention.num_heads, attention.head_dim).unbind(1)
    attended = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=attention.scale)
    return attention.out_proj(attended.transpose(0, 1).reshape(tokens, -1))


def alignment_matrix(weights: torch.Tensor, first_row: int, num_frames: int, filter_width: int) -> np.ndarray:
    """``[rows, frames]`` float32: the heads' weights of rows ``first_row:`` (the decoded
    tokens, not the prompt) over the first ``num_frames`` frames, standardised over the rows
    per head, median-filtered over time, averaged over the heads."""
    weights = weights[:, first_row:, :num_frames].float()
    if weights.shape[1] == 0 or weights.shape[2] == 0:
        return np.zeros((weights.shape[1], weights.shape[2]), dtype=np.float32)
    std, mean = torch.std_mean(weights, dim=-2, keepdim=True, unbiased=False)
    weights = median_filter((weights - mean) / std, filter_width)
    return weights.mean(dim=0).cpu().numpy()
