"""A Llama decoder in plain PyTorch with Hugging Face's weight names and layout.

Parameter names equal those of transformers' LlamaForCausalLM (model.embed_tokens,
model.layers.N.self_attn.q_proj, ..., model.norm, lm_head), RoPE uses HF's
rotate_half convention and RMSNorm computes in fp32, so exporting is a copy of
the state dict (export.py) and kdn's engine or transformers load it unchanged.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Config:
    def __init__(self, vocab_size=258, hidden_size=128, intermediate_size=384,
                 num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, bos_token_id=256, eos_token_id=257):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.tie_word_embeddings = tie_word_embeddings
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @property
    def head_dim(self):
        return self.hidden_size // self.num_attention_heads

    def ToHf(self, torch_dtype="bfloat16"):
        """config.json in the field order kdn-mkmodel writes."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "mlp_bias": False,
            "model_type": "llama",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": torch_dtype,
            "use_cache": True,
            "vocab_size": self.vocab_size,
        }

    @staticmethod
    def FromDict(d):
        keys = Config().__dict__.keys()
        return Config(**{k: d[k] for k in keys if k in d})


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def RotateHalf(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h = c.num_attention_heads
        self.kvh = c.num_key_value_heads
        self.hd = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, cache=None):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kvh, self.hd).transpose(1, 2)
        # In q's dtype: under bf16 autocast, fp32 cos/sin would promote q and
        # k to fp32 while v stays bf16, and SDPA would fall back from the
        # fused kernel to materialized t x t scores.
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + RotateHalf(q) * sin
        k = k * cos + RotateHalf(k) * sin
        if cache is not None:
            if cache:
                k = torch.cat((cache[0], k), dim=2)
                v = torch.cat((cache[1], v), dim=2)
            cache[:] = [k, v]
        rep = self.h // self.kvh
        if cache is None and hasattr(F, "scaled_dot_product_attention"):
            # Training (torch >= 2): fused causal attention, no t x t tensors.
            # Query head i reads KV head i // rep (HF repeat_kv).
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.hd))
        # Query head i reads KV head i // rep (HF repeat_kv); grouped so that no
        # copy of K and V is made.
        q = q.reshape(b, self.kvh, rep * t, self.hd)
        s = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd))
        n = k.shape[2]
        s = s.view(b, self.kvh, rep, t, n) + mask
        p = torch.softmax(s, dim=-1).view(b, self.kvh, rep * t, n)
        o = torch.matmul(p, v).view(b, self.h, t, self.hd)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.hd))


class Mlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = Mlp(c)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = Body(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)
        self._Init()

    def _Init(self):
        # Weights ~ N(0, 1/fan_in): at 0.02 (GPT-2's width-768 value) a model
        # this narrow starts with near-uniform attention and takes thousands
        # of steps to leave that saddle. Output projections are scaled down
        # by sqrt(2 * layers) so that the residual stream does not grow.
        c = self.config
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = p.shape[1] ** -0.5
                if name.endswith("embed_tokens.weight"):
                    std = c.hidden_size ** -0.5
                elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    std /= math.sqrt(2 * c.num_hidden_layers)
                nn.init.normal_(p, std=std)

    def Rope(self, start, t, device):
        pos = torch.arange(start, start + t, device=device).float()
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    def forward(self, ids, caches=None):
        """ids [b, t] -> logits [b, t, vocab], causal.

        Without caches, positions are 0..t-1. With caches (a list of one empty
        list per layer, filled by the first call), ids continue the cached
        sequence: positions start at the cached length.
        """
        b, t = ids.shape
        start = caches[0][0].shape[2] if caches and caches[0] else 0
        x = self.model.embed_tokens(ids)
        cos, sin = self.Rope(start, t, ids.device)
        mask = torch.full((t, start + t), float("-inf"), device=ids.device).triu(start + 1)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, caches[i] if caches is not None else None)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings \
            else self.lm_head.weight
        return F.linear(x, w)

    def HfStateDict(self):
        """Tensors under HF's names (tied lm_head left out, as HF saves it)."""
        return {k: v for k, v in self.state_dict().items() if k != "inv_freq"}
