"""An independent PyTorch reference of the LLaDA2 architecture (Hugging Face model_type
`llada2_moe`), written from the published modelling code's semantics, never from ours:
tiny configs in the real config.json field names, random weights under the real tensor
names, and the forward written out (float32, CPU). The parity tests
(tests/models/test_llada2.py, tests/checkpoint/test_convert_llada2.py) compare our
converted Flax model with it; the tests here check the reference itself.

One deliberate choice: top-k ties. The published code uses torch.topk, whose order among
equal values is unspecified (CPU and CUDA differ); this reference, like our model, takes
the lower index first (a stable descending sort), at both the group and the expert step.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def hf_config(**overrides) -> dict:
    """A tiny llada2_moe config.json: 3 layers (the first dense), 8 experts in 4 groups,
    top-2 experts of the best 2 groups, one shared expert, QK-norm, half-rotary heads,
    GQA (4 query / 2 key-value heads)."""
    hf = {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8,
        "num_experts_per_tok": 2, "num_shared_experts": 1, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
        "score_function": "sigmoid", "moe_router_enable_expert_bias": True,
        "use_qk_norm": True, "use_qkv_bias": False, "use_bias": False, "norm_head": False,
        "partial_rotary_factor": 0.5, "rope_theta": 600000, "rope_scaling": None,
        "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 256,
        "tie_word_embeddings": False, "pad_token_id": 62, "eos_token_id": 62,
        "mask_token_id": 63, "initializer_range": 0.02, "output_router_logits": False,
        "use_cache": False, "torch_dtype": "float32",
    }
    hf.update(overrides)
    return hf


def _layer_is_moe(hf: dict, i: int) -> bool:
    return i >= hf["first_k_dense_replace"]


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint of `hf`, by its published name, in torch layout."""
    d, V, h = hf["hidden_size"], hf["vocab_size"], hf["head_dim"]
    H, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    E, m = hf["num_experts"], hf["moe_intermediate_size"]
    shapes = {"model.word_embeddings.weight": (V, d), "model.norm.weight": (d,)}
    if not hf.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (V, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "attention.query_key_value.weight": ((H + 2 * K) * h, d),
            p + "attention.query_layernorm.weight": (h,),
            p + "attention.key_layernorm.weight": (h,),
            p + "attention.dense.weight": (d, H * h)})
        if not _layer_is_moe(hf, i):
            f = hf["intermediate_size"]
            shapes.update({p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                           p + "mlp.down_proj.weight": (d, f)})
            continue
        shapes.update({p + "mlp.gate.weight": (E, d), p + "mlp.gate.expert_bias": (E,)})
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            shapes.update({q + "gate_proj.weight": (m, d), q + "up_proj.weight": (m, d),
                           q + "down_proj.weight": (d, m)})
        s = m * (hf.get("num_shared_experts") or 0)
        if s:
            q = p + "mlp.shared_experts."
            shapes.update({q + "gate_proj.weight": (s, d), q + "up_proj.weight": (s, d),
                           q + "down_proj.weight": (d, s)})
    return shapes


def random_tensors(hf: dict, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Random weights under the published names: norms near 1 (so they matter), router
    weights large enough that the sigmoid scores spread, a small random expert_bias."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in tensor_shapes(hf).items():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("expert_bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("mlp.gate.weight"):
            t = 0.5 * torch.randn(shape, generator=g)
        else:
            t = 0.1 * torch.randn(shape, generator=g)
        out[name] = t.to(dtype)
    return out


def to_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.float().numpy() for k, v in tensors.items()}


# --------------------------------------------------------------------------- forward

def _rms(x, w, eps):
    x32 = x.float()
    return w.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, rotary_dim, theta):
    """x [b, n, t, h]: the first rotary_dim channels rotated (rotate-half), the rest kept."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    ang = positions.float()[..., None] * inv  # [b, t, r/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    turned = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * cos + turned * sin, rest], -1)


def top_indices(values, k):
    """The k largest along the last axis, ties to the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def route(hf, x, weight, bias, *, group_limit: bool = True):
    """(experts [N, k], weights [N, k]) for x [N, d], as the published gate computes them
    (group_limit=False: the plain top-k over all experts, for tests to compare)."""
    scores = torch.sigmoid(x.float() @ weight.float().T)
    biased = scores + bias.float()
    n, E = biased.shape
    G, k = hf["n_group"], hf["num_experts_per_tok"]
    if group_limit:
        grouped = biased.view(n, G, E // G)
        group_scores = torch.sort(grouped, -1, descending=True).values[..., :2].sum(-1)
        keep = torch.zeros(n, G, dtype=torch.bool)
        keep.scatter_(1, top_indices(group_scores, hf["topk_group"]), True)
        biased = biased.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
    experts = top_indices(biased, k)
    w = scores.gather(1, experts)
    if k > 1:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return experts, w * hf["routed_scaling_factor"]


def _swiglu(x, gate, up, down):
    return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _moe(hf, t, p, x):
    n, d = x.shape
    experts, w = route(hf, x, t[p + "mlp.gate.weight"], t[p + "mlp.gate.expert_bias"])
    y = torch.zeros(n, d)
    for token in range(n):  # token by token, expert by expert: no shared machinery
        for j in range(experts.shape[1]):
            q = f"{p}mlp.experts.{int(experts[token, j])}."
            y[token] += w[token, j] * _swiglu(x[token], t[q + "gate_proj.weight"],
                                              t[q + "up_proj.weight"],
                                              t[q + "down_proj.weight"])
    if hf.get("num_shared_experts"):
        q = p + "mlp.shared_experts."
        y = y + _swiglu(x, t[q + "gate_proj.weight"], t[q + "up_proj.weight"],
                        t[q + "down_proj.weight"])
    return y


@torch.no_grad()
def logits(hf: dict, tensors: dict[str, torch.Tensor], tokens, *, block_ids=None,
           key_mask=None) -> np.ndarray:
    """The model's logits [b, t, V] (float32) for tokens [b, t] at positions 0..t-1.

    block_ids [b, t]: block-causal attention (a query sees keys whose block id is <= its
    own); key_mask [b, t]: False for keys no query may attend; both optional.
    """
    t = {k: v.float() for k, v in tensors.items()}
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    b, T = tokens.shape
    d, h = hf["hidden_size"], hf["head_dim"]
    H, K = hf["num_attention_heads"], hf["num_key_value_heads"]
    eps, theta = hf["rms_norm_eps"], float(hf["rope_theta"])
    rotary = int(h * hf.get("partial_rotary_factor", 1.0))
    positions = torch.arange(T)[None].expand(b, T)
    allowed = torch.ones(b, 1, T, T, dtype=torch.bool)
    if block_ids is not None:
        ids = torch.as_tensor(np.asarray(block_ids))
        allowed &= (ids[:, None, :] <= ids[:, :, None])[:, None]
    if key_mask is not None:
        allowed &= torch.as_tensor(np.asarray(key_mask))[:, None, None, :]
    x = t["model.word_embeddings.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, t[p + "input_layernorm.weight"], eps)
        qkv = (a @ t[p + "attention.query_key_value.weight"].T).view(b, T, H + 2 * K, h)
        q, k, v = (qkv[:, :, :H].transpose(1, 2), qkv[:, :, H:H + K].transpose(1, 2),
                   qkv[:, :, H + K:].transpose(1, 2))
        q = _rms(q, t[p + "attention.query_layernorm.weight"], eps)
        k = _rms(k, t[p + "attention.key_layernorm.weight"], eps)
        q, k = _rope(q, positions, rotary, theta), _rope(k, positions, rotary, theta)
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(h)
        s = s.masked_fill(~allowed, float("-inf"))
        o = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, T, H * h)
        x = x + o @ t[p + "attention.dense.weight"].T
        m = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        if _layer_is_moe(hf, i):
            x = x + _moe(hf, t, p, m.reshape(b * T, d)).view(b, T, d)
        else:
            x = x + _swiglu(m, t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"],
                            t[p + "mlp.down_proj.weight"])
    x = _rms(x, t["model.norm.weight"], eps)
    head = t["model.word_embeddings.weight" if hf.get("tie_word_embeddings")
             else "lm_head.weight"]
    return (x @ head.T).numpy()


# --------------------------------------------------------------- the reference's own checks

def test_route_respects_the_group_limit_and_normalises():
    hf = hf_config()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 32, generator=g), torch.randn(8, 32, generator=g)
    bias = 0.1 * torch.randn(8, generator=g)
    experts, weights = route(hf, x, w, bias)
    groups = experts // 2
    # every token's experts come from at most topk_group = 2 groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    torch.testing.assert_close(weights.sum(-1), torch.full((64,), 2.5))


def test_top_indices_breaks_ties_to_the_lower_index():
    values = torch.tensor([[0.5, 0.9, 0.5, 0.9, 0.1, 0.5]])
    assert top_indices(values, 3).tolist() == [[1, 3, 0]]


def test_tensor_shapes_cover_dense_and_expert_layers():
    shapes = tensor_shapes(hf_config())
    assert "model.layers.0.mlp.gate_proj.weight" in shapes
    assert "model.layers.0.mlp.gate.weight" not in shapes
    assert shapes["model.layers.2.mlp.experts.7.down_proj.weight"] == (32, 16)
    assert shapes["model.layers.1.attention.query_key_value.weight"] == (64, 32)
