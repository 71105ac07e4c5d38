"""Decoder-only transformer of the Llama / Qwen3 family, parameter names as in Hugging Face."""
import torch
from torch import nn
import torch.nn.functional as F

from kvturn.model.attention import AttentionMetadata, paged_attention
from kvturn.model.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


class RotaryEmbedding(nn.Module):
    """Angles are computed for each step's positions: a table for 131,072 positions would take 64 MiB a worker."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        # on the CPU even when the model is built on the meta device: computed, never loaded
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        inv_freq = 1.0 / (theta ** exponents)
        self.inv_freq = inv_freq  # not a buffer: it stays float32 when the model is cast to bfloat16

    def angles(self, positions, dtype):
        """cos and sin for `positions`, shaped to broadcast over heads; computed once per forward."""
        freqs = positions.to(torch.float32).unsqueeze(1) * self.inv_freq.unsqueeze(0)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().unsqueeze(1).to(dtype), angles.sin().unsqueeze(1).to(dtype)

    @staticmethod
    def apply(angles, q, k):
        cos, sin = angles
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.has_qk_norm = cfg.has_qk_norm
        self.scale = self.head_dim ** -0.5
        self.qkv: nn.Linear | None = None

    def fuse(self) -> None:
        """One matmul for q, k and v (the separate projections keep the Hugging Face names for loading)."""
        bias = None if self.q_proj.bias is None else torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        self.qkv = nn.Linear(self.q_proj.in_features, 1, bias=bias is not None, device="meta")
        self.qkv.weight = nn.Parameter(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]),
                                       requires_grad=False)
        if bias is not None:
            self.qkv.bias = nn.Parameter(bias, requires_grad=False)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x, angles, kv_pool, meta: AttentionMetadata):
        tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.qkv is not None:
            q, k, v = self.qkv(x).split([q_size, kv_size, kv_size], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(tokens, self.num_heads, self.head_dim)
        k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(angles, q, k)
        out = paged_attention(q, k, v, kv_pool, self.layer, meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up = nn.Linear(self.gate_proj.in_features, 1, bias=False, device="meta")
        self.gate_up.weight = nn.Parameter(torch.cat([self.gate_proj.weight, self.up_proj.weight]), requires_grad=False)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, angles, kv_pool, meta):
        x = x + self.self_attn(self.input_layernorm(x), angles, kv_pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Left uninitialised: models are built on the meta device and loaded, where an init imports torch._dynamo
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Takes a flat batch of new tokens and returns hidden states; `logits` maps chosen rows to vocab."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, input_ids, positions, kv_pool, meta: AttentionMetadata, before_layer=None):
        x = self.model.embed_tokens(input_ids)
        angles = self.rotary.angles(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            if before_layer is not None:
                before_layer(i)
            x = layer(x, angles, kv_pool, meta)
        return self.model.norm(x)

    def fuse(self) -> None:
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def logits(self, hidden):
        return self.lm_head(hidden).float()
