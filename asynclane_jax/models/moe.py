"""Mixture-of-experts arithmetic of the LLaDA2 family (Hugging Face `llada2_moe`): the
router and the routed experts, as pure functions of arrays. The modules that hold the
parameters are in asynclane_jax.models.model (`SparseMoE`).

Routing (what the published modelling code computes, docs/llada2.md):
  1. scores = sigmoid(x @ W) over the E experts, in float32;
  2. for selection only, the stored `expert_bias` is added: biased = scores + bias;
  3. group limit: the E experts form G consecutive groups; a group's score is the sum
     of its two best biased scores; only the experts of the `topk_groups` best groups
     may be chosen;
  4. the top-k experts by biased score among those are chosen;
  5. their weights are the *unbiased* scores, normalised to sum to one (when k > 1),
     times `routed_scaling`.
Ties are broken towards the lower index, at both the group and the expert step
(`jax.lax.top_k`'s order; the published code's torch.topk leaves tie order unspecified).

Shapes: N tokens (batch and positions flattened), d model width, E experts, k experts
per token, m one expert's SwiGLU width, G expert groups.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(x, kernel, expert_bias, *, top_k: int, n_groups: int, topk_groups: int,
          scaling: float):
    """The experts each token is sent to and their weights.

    Args:
      x: [N, d] the layer's normalised input.
      kernel: [d, E] the router's weights (the transpose of the published [E, d]).
      expert_bias: [E] the stored selection bias.
      top_k, n_groups, topk_groups, scaling: the config's n_experts_per_tok,
        n_expert_groups, n_topk_groups and routed_scaling.
    Returns:
      (experts [N, k] int32, weights [N, k] float32).
    """
    n, n_experts = x.shape[0], kernel.shape[1]
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), kernel.astype(jnp.float32))
    scores = jax.nn.sigmoid(logits)
    biased = scores + expert_bias.astype(jnp.float32)
    per_group = n_experts // n_groups
    best_two = jax.lax.top_k(biased.reshape(n, n_groups, per_group), 2)[0]
    group_scores = best_two[..., 0] + best_two[..., 1]  # [N, G]
    chosen_groups = jax.lax.top_k(group_scores, topk_groups)[1]  # [N, topk_groups]
    allowed = jnp.any(chosen_groups[:, :, None] == jnp.arange(n_groups), axis=1)  # [N, G]
    allowed = jnp.repeat(allowed, per_group, axis=1)  # [N, E]
    experts = jax.lax.top_k(jnp.where(allowed, biased, -jnp.inf), top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if top_k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts.astype(jnp.int32), weights * jnp.float32(scaling)


def grouped_matmul(lhs, rhs, sizes, dtype, scale=None, row_groups=None):
    """One projection of the sorted (token, expert) rows: `jax.lax.ragged_dot` of lhs
    [R, in] (rows grouped by expert, group g `sizes[g]` rows; rows past the groups come
    out zero) with rhs [G, in, out], accumulated in float32, returned in dtype.

    int8 weights (asynclane_jax.models.quantize): rhs holds the int8 values, converted
    to dtype inside the ragged_dot operand, and scale [G, 1, out] (float32) their scale
    per (expert, output channel); each output row is multiplied by its expert's scale
    row, row_groups [R] (the expert of each row): y = (x @ Wq_e) * s_e, which equals x @
    (Wq_e * s_e) since the scale is per output column. No dequantized copy of the
    weights is made."""
    y = jax.lax.ragged_dot(lhs, rhs.astype(dtype), sizes, preferred_element_type=jnp.float32)
    if scale is not None:
        y = y * jnp.take(scale[:, 0, :].astype(jnp.float32), row_groups, axis=0)
    return y.astype(dtype)


def routed_experts(x, experts, weights, gate, up, down, dtype, scales=None):
    """The weighted sum of each token's chosen experts' SwiGLU outputs, without a dense
    all-experts product: the N*k (token, expert) pairs are sorted by expert and each
    projection is one `jax.lax.ragged_dot` over the sorted rows (a grouped matmul: rows
    of expert e multiply expert e's matrix), then the rows are put back in token order.

    Args:
      x: [N, d]; experts, weights: [N, k] from `route`.
      gate, up: [E, d, m]; down: [E, m, d] the stacked expert kernels (int8 values when
        scales are given).
      dtype: the compute dtype (matmuls accumulate in float32).
      scales: None for float kernels, or the int8 kernels' scales (gate [E, 1, m], up
        [E, 1, m], down [E, 1, d], float32), applied to the output rows
        (`grouped_matmul`).
    Returns:
      [N, d] in dtype.
    """
    n, k = experts.shape
    n_experts = gate.shape[0]
    flat = experts.reshape(-1)  # [N*k], pair p = (token p // k, its (p % k)-th expert)
    order = jnp.argsort(flat, stable=True)
    rows = jnp.take(x.astype(dtype), order // k, axis=0)  # [N*k, d], grouped by expert
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)  # [E]
    s_gate, s_up, s_down = scales if scales is not None else (None, None, None)
    row_groups = jnp.take(flat, order) if scales is not None else None  # each row's expert

    def grouped(lhs, rhs, scale):
        return grouped_matmul(lhs, rhs, sizes, dtype, scale, row_groups)

    hidden = jax.nn.silu(grouped(rows, gate, s_gate)) * grouped(rows, up, s_up)  # [N*k, m]
    out = grouped(hidden, down, s_down)  # [N*k, d], sorted
    out = jnp.zeros_like(out).at[order].set(out)  # back to pair order
    mixed = jnp.sum(out.reshape(n, k, -1).astype(jnp.float32) * weights[..., None], axis=1)
    return mixed.astype(dtype)


__all__ = ["grouped_matmul", "route", "routed_experts"]
