"""Gated DeltaNet's operations (``vlmd/layers/linear_attention/gated_delta.py``) against
transformers' torch path for Qwen3.5 (``modeling_qwen3_5``): the causal convolution with its
state, the chunked and recurrent delta rule (grouped value heads, prompts that are not a
multiple of the chunk, state carried across a split prompt and into decodes), the gated norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlmd.layers.linear_attention.gated_delta import (
    GatedRMSNorm,
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    gate_decay,
    recurrent_gated_delta_step,
)

reference = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

# Float32 rounding of sums over at most a few hundred tokens.
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _conv_weights(channels: int, kernel: int, bias: bool, seed: int = 0):
    generator = _generator(seed)
    weight = torch.randn(channels, kernel, generator=generator) * 0.5
    return weight, (torch.randn(channels, generator=generator) if bias else None)


@pytest.mark.parametrize("bias", [False, True])
def test_conv_prefill_equals_reference(bias):
    weight, conv_bias = _conv_weights(24, 4, bias)
    x = torch.randn(37, 24, generator=_generator(1))
    ours, state = causal_conv1d_prefill(x, weight, conv_bias, None)
    theirs = reference.causal_conv1d_fn(x.t().unsqueeze(0), weight, conv_bias, activation="silu")[0].t()
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    # The state is the last K - 1 inputs, float32, channel-major.
    assert state.dtype == torch.float32 and state.shape == (24, 3)
    torch.testing.assert_close(state, x[-3:].t())


@pytest.mark.parametrize("split", [1, 2, 3, 20])
def test_conv_prefill_carries_state_across_a_split_prompt(split):
    """Two pieces (the first as short as one token, shorter than the kernel's history) give
    the one piece's outputs and final state."""
    weight, conv_bias = _conv_weights(16, 4, True)
    x = torch.randn(30, 16, generator=_generator(2))
    whole, whole_state = causal_conv1d_prefill(x, weight, conv_bias, None)
    first, state = causal_conv1d_prefill(x[:split], weight, conv_bias, None)
    second, state = causal_conv1d_prefill(x[split:split + 2], weight, conv_bias, state)
    third, state = causal_conv1d_prefill(x[split + 2:], weight, conv_bias, state)
    torch.testing.assert_close(torch.cat([first, second, third]), whole, **TOLERANCE)
    torch.testing.assert_close(state, whole_state)


def test_conv_decode_equals_reference_update():
    weight, conv_bias = _conv_weights(20, 4, True)
    generator = _generator(3)
    states = torch.randn(5, 20, 3, generator=generator)
    x = torch.randn(5, 20, generator=generator)
    ours, new_states = causal_conv1d_decode(x, weight, conv_bias, states)
    conv_state = states.clone()
    theirs = reference.causal_conv1d_update(x.unsqueeze(-1), conv_state, weight, conv_bias, activation="silu")
    torch.testing.assert_close(ours, theirs[..., 0], **TOLERANCE)
    torch.testing.assert_close(new_states, conv_state)


def test_conv_decode_continues_a_prefill():
    weight, conv_bias = _conv_weights(8, 4, False)
    x = torch.randn(12, 8, generator=_generator(4))
    whole, _ = causal_conv1d_prefill(x, weight, conv_bias, None)
    _, state = causal_conv1d_prefill(x[:9], weight, conv_bias, None)
    states = state.unsqueeze(0)
    for row in range(9, 12):
        y, states = causal_conv1d_decode(x[row:row + 1], weight, conv_bias, states)
        torch.testing.assert_close(y[0], whole[row], **TOLERANCE)


def _rule_inputs(tokens: int, key_heads: int, value_heads: int, key_dim: int, value_dim: int, seed: int,
                 batch: tuple[int, ...] = ()):
    generator = _generator(seed)
    q = torch.randn(*batch, tokens, key_heads, key_dim, generator=generator)
    k = torch.randn(*batch, tokens, key_heads, key_dim, generator=generator)
    v = torch.randn(*batch, tokens, value_heads, value_dim, generator=generator)
    a = torch.randn(*batch, tokens, value_heads, generator=generator)
    g = gate_decay(a, torch.randn(value_heads, generator=generator) * 0.5, torch.rand(value_heads, generator=generator))
    beta = torch.randn(*batch, tokens, value_heads, generator=generator).sigmoid()
    return q, k, v, g, beta


def _state(value_heads, key_dim, value_dim, seed, batch: tuple[int, ...] = ()):
    return torch.randn(*batch, value_heads, key_dim, value_dim, generator=_generator(seed)) * 0.3


def _their_chunked(q, k, v, g, beta, state):
    out, final = reference.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=None if state is None else state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def _their_recurrent(q, k, v, g, beta, state):
    """Batched: [N, T, ...] inputs, [N, Hv, Dk, Dv] states."""
    return reference.torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                      output_final_state=True, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("tokens,key_heads,value_heads,fresh", [
    (100, 2, 4, False),  # grouped value heads, a last chunk of 36
    (64, 2, 2, True),  # exactly one chunk, no state
    (5, 1, 3, False),  # shorter than a chunk
    (130, 2, 6, True),
])
def test_chunked_rule_equals_reference(tokens, key_heads, value_heads, fresh):
    q, k, v, g, beta = _rule_inputs(tokens, key_heads, value_heads, 16, 8, seed=tokens)
    state = None if fresh else _state(value_heads, 16, 8, seed=7)
    ours, ours_final = chunk_gated_delta_rule(q, k, v, g, beta, state)
    theirs, their_final = _their_chunked(q, k, v, g, beta, state)
    assert ours.shape == v.shape and ours_final.shape == (value_heads, 16, 8) and ours_final.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, **TOLERANCE)
    torch.testing.assert_close(ours_final, their_final, **TOLERANCE)
    # And the token-by-token recurrence (the rule's definition) agrees.
    step, step_final = _their_recurrent(q[None], k[None], v[None], g[None], beta[None],
                                        None if state is None else state[None])
    torch.testing.assert_close(ours, step[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours_final, step_final[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("split", [1, 63, 64, 70])
def test_chunked_rule_carries_state_across_a_split_prompt(split):
    q, k, v, g, beta = _rule_inputs(150, 2, 4, 16, 16, seed=11)
    whole, whole_final = chunk_gated_delta_rule(q, k, v, g, beta, None)
    first, state = chunk_gated_delta_rule(q[:split], k[:split], v[:split], g[:split], beta[:split], None)
    second, state = chunk_gated_delta_rule(q[split:], k[split:], v[split:], g[split:], beta[split:], state)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, whole_final, rtol=1e-4, atol=1e-4)


def test_recurrent_step_equals_reference_for_a_batch():
    """N sequences with their own states, one token each, grouped value heads."""
    q, k, v, g, beta = _rule_inputs(1, 2, 4, 16, 8, seed=12, batch=(3,))
    states = _state(4, 16, 8, seed=13, batch=(3,))
    before = states.clone()
    ours, new_states = recurrent_gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], states)
    assert torch.equal(states, before)  # the caller's states are left as they are
    theirs, their_states = _their_recurrent(q, k, v, g, beta, states)
    torch.testing.assert_close(ours, theirs[:, 0], **TOLERANCE)
    torch.testing.assert_close(new_states, their_states, **TOLERANCE)


def test_decode_steps_after_a_prefill_equal_the_reference():
    """A prompt through the chunked rule, then decodes one token at a time from its state,
    equal transformers' recurrent path over the whole sequence."""
    q, k, v, g, beta = _rule_inputs(75, 2, 4, 16, 8, seed=14)
    theirs, their_final = _their_recurrent(q[None], k[None], v[None], g[None], beta[None], None)
    prompt = 70
    out, state = chunk_gated_delta_rule(q[:prompt], k[:prompt], v[:prompt], g[:prompt], beta[:prompt], None)
    outputs, states = [out], state[None]
    for row in range(prompt, 75):
        out, states = recurrent_gated_delta_step(q[row:row + 1], k[row:row + 1], v[row:row + 1],
                                                 g[row:row + 1], beta[row:row + 1], states)
        outputs.append(out)
    torch.testing.assert_close(torch.cat(outputs), theirs[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[0], their_final[0], rtol=1e-4, atol=1e-4)


def test_rule_rejects_value_heads_not_a_multiple_of_key_heads():
    q, k, v, g, beta = _rule_inputs(4, 2, 3, 8, 8, seed=15)
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, v, g, beta, None)


def test_half_precision_inputs_keep_float32_states():
    q, k, v, g, beta = _rule_inputs(20, 2, 4, 16, 8, seed=16)
    out, state = chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), None)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    full, _ = chunk_gated_delta_rule(q, k, v, g, beta, None)
    torch.testing.assert_close(out.float(), full, rtol=0.05, atol=0.05)
    weight, _ = _conv_weights(8, 4, False)
    y, conv_state = causal_conv1d_prefill(torch.randn(5, 8).bfloat16(), weight, None, None)
    assert y.dtype == torch.bfloat16 and conv_state.dtype == torch.float32
    y, conv_states = causal_conv1d_decode(torch.randn(2, 8).bfloat16(), weight, None, torch.zeros(2, 8, 3))
    assert y.dtype == torch.bfloat16 and conv_states.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_norm_equals_reference(dtype):
    generator = _generator(17)
    theirs = reference.Qwen3_5RMSNormGated(16, eps=1e-6)
    ours = GatedRMSNorm(16, eps=1e-6)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, generator=generator))
        ours.weight.copy_(theirs.weight)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = torch.randn(9, 16, generator=generator).to(dtype)
    gate = torch.randn(9, 16, generator=generator).to(dtype)
    torch.testing.assert_close(ours(x, gate), theirs(x, gate), rtol=0, atol=0)


def test_gate_decay_is_the_reference_formula():
    generator = _generator(18)
    a, a_log, dt_bias = torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator), torch.rand(4)
    torch.testing.assert_close(gate_decay(a, a_log, dt_bias), -a_log.exp() * F.softplus(a + dt_bias))
