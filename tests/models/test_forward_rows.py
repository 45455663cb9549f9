"""`forward(logits_index=...)` runs the last layer's attention and MLP on the read rows
alone: its logits are the whole forward's at those rows (to float32 rounding), its K/V
cache the same, in both layer layouts, with padding, block-causal attention, grouped
K/V heads, a cache and a key bound; and RoPE's shared tables rotate as `rope` does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asynclane_jax.models import KVCache, init_model, tiny_dream, tiny_llada
from asynclane_jax.models.model import apply_rope, rope, rope_tables

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-5


def _calls(model, tokens, key_mask, block_ids, read, q_cols, logits_index):
    """A full forward writing the cache, then a cached call of q_cols with a key bound;
    logits at `read` / `logits_index` (None: every row)."""
    b, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T), (b, T))
    full, cache = model.forward(tokens, pos, key_mask=key_mask, block_ids=block_ids,
                                cache=KVCache.zeros(model.cfg, b, T), write_index=pos,
                                logits_index=read)
    tq = jnp.take_along_axis(tokens, q_cols, 1)
    cached, cache2 = model.forward(tq, q_cols, key_mask=key_mask, cache=cache,
                                   write_index=q_cols, block_ids=block_ids, key_len=T - 4,
                                   logits_index=logits_index)
    return full, cache, cached, cache2


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("cfg,blocks", [
    (tiny_llada().replace(n_layers=3), True),
    (tiny_dream().replace(n_layers=3), False)],
    ids=["llada-block-causal", "dream-gqa"])
def test_read_rows_equal_the_whole_forward(cfg, blocks, scan):
    model = init_model(cfg.replace(scan_layers=scan), seed=5)
    rng = np.random.default_rng(1)
    b, T, n = 3, 24, 5
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, T)), jnp.int32)
    key_mask = jnp.asarray(np.arange(T)[None] >= np.array([[0], [3], [6]]))
    block_ids = jnp.asarray(np.arange(T)[None].repeat(b, 0) // 8) if blocks else None
    read = jnp.asarray(np.stack([np.sort(rng.permutation(T)[:n]) for _ in range(b)]),
                       jnp.int32)
    q_cols = jnp.asarray(np.sort(rng.permutation(T - 4)[:8])[None].repeat(b, 0), jnp.int32)
    at = jnp.asarray(rng.integers(0, 8, (b, 3)), jnp.int32)
    whole = _calls(model, tokens, key_mask, block_ids, None, q_cols, None)
    rows = _calls(model, tokens, key_mask, block_ids, read, q_cols, at)
    np.testing.assert_allclose(np.asarray(rows[0]),
                               np.take_along_axis(np.asarray(whole[0]),
                                                  np.asarray(read)[:, :, None], 1),
                               atol=TOL, rtol=TOL)
    np.testing.assert_allclose(np.asarray(rows[2]),
                               np.take_along_axis(np.asarray(whole[2]),
                                                  np.asarray(at)[:, :, None], 1),
                               atol=TOL, rtol=TOL)
    for got, want in ((rows[1], whole[1]), (rows[3], whole[3])):
        np.testing.assert_allclose(np.asarray(got.k), np.asarray(want.k), atol=TOL, rtol=TOL)
        np.testing.assert_allclose(np.asarray(got.v), np.asarray(want.v), atol=TOL, rtol=TOL)


def test_shared_tables_rotate_as_rope():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 7, 3, 8)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 100, (2, 7)), jnp.int32)
    got = apply_rope(x, *rope_tables(pos, 8, 10000.0))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(rope(x, pos, 10000.0)))
    # rotate-half: the pair (x_i, x_{i+h/2}) turns by pos * theta^(-2i/h)
    i, p = 1, np.asarray(pos)[..., None]
    a = p * 10000.0 ** (-2 * i / 8)
    x0, x1 = np.asarray(x)[..., i], np.asarray(x)[..., i + 4]
    np.testing.assert_allclose(np.asarray(got)[..., i], x0 * np.cos(a) - x1 * np.sin(a),
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(got)[..., i + 4], x1 * np.cos(a) + x0 * np.sin(a),
                               atol=1e-5)
