"""Our Llama decoder over the paged KV cache: RMSNorm, RoPE (theta/scaling), GQA.

Q/K/V and gate/up projections are fused into one matmul each; each checkpoint tensor goes
through its parameter's ``weight_loader`` (vlmd/layers/linear), which places it in its
shard of the fused weight (and, under tensor parallelism, takes only this rank's slice). Tokens of every request in a step are one
flattened ``[T, hidden]`` batch; only attention looks at request boundaries.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vlmd.layers.activation import check_activation, gated_activation
from vlmd.layers.attention import AttentionMetadata, OutputRows, paged_attention, store_kv
from vlmd.layers.decoder_structure import DecoderStructure, PreNormLayer
from vlmd.layers.linear import (
    SINGLE,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
)
from vlmd.layers.norm import RMSNorm
from vlmd.layers.rotary import RotaryEmbedding, rope_parameters, rotate_qkv
from vlmd.models.base import KVSpec
from vlmd.models.loader import load_into


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool | None = None, tp: TPGroup = SINGLE):
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = _head_dim(config)
        bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = bias if qkv_bias is None else qkv_bias  # Qwen2: q/k/v have a bias, o_proj not
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias, tp=tp
        )
        # This rank's heads (all of them at tp size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(num_heads * self.head_dim, config.hidden_size, bias=bias, tp=tp)
        self.scale = self.head_dim**-0.5
        self.rotary = rotary

    def project_qkv(self, hidden, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D], q and k rotated (a subclass may norm them first)."""
        return rotate_qkv(self.qkv_proj(hidden), self.num_heads, self.num_kv_heads, self.head_dim, cos, sin)

    def forward(self, hidden, cos, sin, kv_cache, meta: AttentionMetadata, outputs: OutputRows | None = None):
        """[T, hidden] -> [T, hidden], or with ``outputs`` -> [R, hidden] for its rows alone."""
        tokens = hidden.shape[0]
        q, k, v = self.project_qkv(hidden, cos, sin)
        if outputs is not None:
            # Every row's K/V go to the cache (later tokens attend to them); only the used
            # rows' queries attend. The q columns of the other rows are still computed: a
            # separate K/V product would need a second copy of the fused weight.
            store_kv(k, v, kv_cache, meta)
            rows = outputs.rows
            if outputs.meta is None:  # no row of this step is used (chunks that sample nothing)
                return hidden.new_empty(0, hidden.shape[1])
            q, k, v, meta = q[rows], k[rows], v[rows], outputs.meta
            tokens = rows.shape[0]
        attended = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(attended.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TPGroup = SINGLE):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [config.intermediate_size] * 2, bias=bias, tp=tp
        )
        self.intermediate = self.gate_up_proj.output_sizes[0]
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=bias, tp=tp)
        self.activation = check_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_activation(self.gate_up_proj(x), self.intermediate, self.activation))


class LlamaDecoderLayer(nn.Module):
    attention_class = LlamaAttention  # a subclass's layer may change its attention alone

    def __init__(self, config, rotary: RotaryEmbedding, qkv_bias: bool | None = None, tp: TPGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_class(config, rotary, qkv_bias, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta, outputs: OutputRows | None = None):
        """``hidden``: the previous layer's MLP output, to be added to ``residual``, the
        running sum (None at the first layer, where ``hidden`` is the embeddings). Returns
        this layer's (MLP output, running sum before it): each add happens inside the next
        norm, fused with it. The running sum is updated in place, so at the first layer it
        starts as a copy (the embeddings are the caller's)."""
        if residual is None:
            residual = hidden.clone()
            normed = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm.add_forward(residual, hidden)
        attended = self.self_attn(normed, cos, sin, kv_cache, meta, outputs)
        if outputs is not None:
            residual = residual[outputs.rows]
        normed, residual = self.post_attention_layernorm.add_forward(residual, attended)
        return self.mlp(normed), residual


class LlamaForCausalLM(nn.Module):
    """Text decoder; families feed it input embeddings with media rows overwritten."""

    # checkpoint name fragment -> (our parameter fragment, shard id for its weight_loader)
    _STACKED = {
        ".q_proj.": (".qkv_proj.", "q"),
        ".k_proj.": (".qkv_proj.", "k"),
        ".v_proj.": (".qkv_proj.", "v"),
        ".gate_proj.": (".gate_up_proj.", 0),
        ".up_proj.": (".gate_up_proj.", 1),
    }

    layer_class = LlamaDecoderLayer

    def __init__(
        self, config, *, qkv_bias: bool | None = None, rotary: RotaryEmbedding | None = None, tp: TPGroup = SINGLE
    ):
        """``qkv_bias`` overrides ``config.attention_bias`` for q/k/v only; ``rotary``
        replaces the config's plain RoPE (e.g. M-RoPE); both are for Llama-like subclasses.
        ``tp``: this process's tensor-parallel rank (the embeddings and lm_head stay whole)."""
        super().__init__()
        self.config = config
        theta, scaling = rope_parameters(config)
        head_dim = _head_dim(config)
        if rotary is None:
            rotary = RotaryEmbedding(head_dim, config.max_position_embeddings, theta, scaling)
        self.rotary = rotary
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.make_layer(config, index, qkv_bias, tp) for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ReplicatedLinear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.decoder_structure = self._describe(tp)
        self.kv_spec = KVSpec(
            num_layers=config.num_hidden_layers,
            num_kv_heads=self.layers[0].self_attn.num_kv_heads,
            head_dim=head_dim,
        )

    def make_layer(self, config, index: int, qkv_bias: bool | None, tp: TPGroup) -> nn.Module:
        """Layer ``index``: a ``layer_class`` (a decoder whose layers differ by index, such
        as one with experts on some, builds each itself)."""
        return self.layer_class(config, self.rotary, qkv_bias, tp)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, inputs_embeds, positions, meta: AttentionMetadata, kv_caches, outputs: OutputRows | None = None
    ) -> torch.Tensor:
        """Final hidden states of every row, or with ``outputs`` of its rows alone: then the
        last layer runs only those rows (in a prefill of n tokens, 1/n of its work but the
        K/V product; the small LLaVA's last layer is ~1/9 of its decoder)."""
        cos, sin = self.rotary.cos_sin(positions, inputs_embeds.dtype)
        # The backend may run the whole step itself (a decoder it cannot describe as data,
        # ``decoder_structure`` None, always runs its modules).
        if self.decoder_structure is not None:
            stepped = meta.backend.decode_step(self.decoder_structure, inputs_embeds, cos[:, 0], sin[:, 0], meta,
                                               kv_caches, outputs)
            if stepped is not None:
                return stepped
        hidden, residual = inputs_embeds, None
        last = len(self.layers) - 1
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta, outputs if index == last else None)
        return self.norm.add_forward(residual, hidden)[0]

    def _describe(self, tp: TPGroup) -> DecoderStructure | None:
        """This decoder as data, for a backend that runs a whole decode step itself."""
        attn, mlp = self.layers[0].self_attn, self.layers[0].mlp
        return DecoderStructure(
            layers=tuple(PreNormLayer(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                      layer.post_attention_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                         for layer in self.layers),
            final_norm=self.norm, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=mlp.intermediate, scale=attn.scale, eps=self.layers[0].input_layernorm.eps,
            activation=mlp.activation, tensor_parallel=tp.size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def logits_head(self) -> ReplicatedLinear:
        """The product ``compute_logits`` is (a row per sequence in a decode step):
        ``--quantization int8`` quantizes it with the decoder's (``layers/linear/quantize.py``).
        A head tied to ``embed_tokens`` then drops only its own reference to the float
        weight: the embedding lookup stays float."""
        return self.lm_head

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named weights (``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``).

        Returns the names of our parameters that were filled.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            target = name.removeprefix("model.")
            shard = None
            for fragment, (fused, index) in self._STACKED.items():
                if fragment in target:
                    target, shard = target.replace(fragment, fused), index
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            load_into(params[target], tensor, name, shard)
            loaded.add(target)
        return loaded
