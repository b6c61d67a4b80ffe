"""Our own forward pass for the Llama family (Llama 1-3, SmolLM, Mistral, Qwen2, Qwen3).

The model owns no KV cache and no attention algorithm: each layer computes q, k, v,
rotates k at the tokens' positions, and hands (q un-rotated, k rotated, v) to an
`attention` callable supplied by the caller. That lets the indexer, the engine's
three modes and the tests decide where keys live and how positions are applied,
while the weights and the arithmetic stay in one plain file (as in gpt-fast).

Tokens are packed: one flat sequence of T tokens, possibly from many requests;
`positions` gives each token's logical position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from lazyrag.kernels.rope import RopeTable, apply_rope, rope_table

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool            # Qwen2
    qk_norm: bool             # Qwen3: RMSNorm over head_dim on q and k before RoPE
    tie_word_embeddings: bool
    rope: dict                # transformers' rope_parameters (rope_type, rope_theta, scaling...)
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        family = hf_config.model_type
        if family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model family {family!r} is not supported; lazyrag runs {', '.join(SUPPORTED_FAMILIES)}"
            )
        rope = dict(getattr(hf_config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            # dynamic NTK and longrope change the frequencies with the sequence length,
            # so a key stored once could not be reused at another length.
            raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        return cls(
            family=family,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            qkv_bias=bool(getattr(hf_config, "attention_bias", False)) or family == "qwen2",
            qk_norm=family == "qwen3",
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rope=rope,
            max_position_embeddings=hf_config.max_position_embeddings,
        )


def rope_frequencies(hf_config) -> tuple[torch.Tensor, float]:
    """The model's own inverse frequencies (fp32, [head_dim/2]) and cos/sin scale.

    Taken from transformers' rope initialisers, so llama3 / linear / YaRN scaling
    is exactly what the model was trained with.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type == "default":
        params = hf_config.rope_parameters
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        # the same float32 expression as transformers, so the frequencies match bit for bit
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        return inv_freq, 1.0
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rotate(x: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate x [T, H, D] to the positions of `table` (rope_table of [T] positions): the kernels'
    own RoPE (rotate-half, fp32 maths), so keys rotated here and queries rotated inside the
    kernels agree exactly."""
    return apply_rope(x.float(), table).to(x.dtype)


class Attention(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] un-rotated; k [T, Hkv, D] rotated at the tokens' positions; v [T, Hkv, D].
        Returns the attention output [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 statistics, as transformers does, so fp16/bf16 match its numbers
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def attention_inputs(self, x: torch.Tensor, keys_at: RopeTable, rope_scale: float = 1.0):
        """q (un-rotated), k (rotated to `keys_at`) and v of the hidden states x [T, hidden]."""
        cfg = self.cfg
        h = self.input_norm(x)
        q = self.q_proj(h).view(-1, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(h).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(h).view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope_scale != 1.0:
            q, k = q * rope_scale, k * rope_scale
        return q, rotate(k, keys_at), v

    def after_attention(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The residual stream after this layer, from its input x and its attention output o [T, Hq, D]."""
        x = x + self.o_proj(o.reshape(-1, self.cfg.num_heads * self.cfg.head_dim))
        h = self.post_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scale: float = 1.0):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # YaRN scales cos/sin; as rotation is linear, scaling q and k before it is the same.
        self.rope_scale = rope_scale

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention: Attention,
                key_positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions: [T]. Returns the final hidden states [T, hidden].
        key_positions: where each token's key is rotated to, if not its position (a chunk page
        recomputed for one request keeps the chunk-local positions of the shared page)."""
        key_positions = positions if key_positions is None else key_positions
        keys_at = rope_table(key_positions, self.inv_freq)  # once a step: every layer's keys sit there
        x = self.embed(tokens)
        for i, blk in enumerate(self.layers):
            x = blk.after_attention(x, attention(i, *blk.attention_inputs(x, keys_at, self.rope_scale)))
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Take weights from a transformers Llama-family state dict (names mapped, tensors shared)."""
        ours: dict[str, torch.Tensor] = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
        ours["lm_head.weight"] = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
        names = {
            "input_norm": "input_layernorm", "post_norm": "post_attention_layernorm",
            "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
            "o_proj": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
            "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
        }
        for key in self.state_dict():
            if key in ours or not key.startswith("layers."):
                continue
            _, idx, mod, param = key.split(".")
            ours[key] = sd[f"model.layers.{idx}.{names[mod]}.{param}"]
        missing, unexpected = self.load_state_dict(ours, strict=False, assign=True)
        if missing or unexpected:
            raise ValueError(f"weights do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
