"""The server's footprint (`serve --dry-run`) of a mixture-of-experts model, LLaDA2-mini,
from its config alone: every routed expert in the weights, the K/V cache as a dense
model's (layers x K/V heads x head width)."""

from __future__ import annotations

from asynclane_jax.models import preset
from asynclane_jax.serve.footprint import footprint

LLADA2_MINI_PARAMS = 16_255_643_392  # the published safetensors index's, docs/llada2.md


def test_llada2_mini_weights_and_cache():
    cfg = preset("llada2-mini")
    out = footprint("llada2-mini", sampler="llada2", slots=2, gen_lengths=(64,),
                    max_prompt=64, kv_budget="8GiB")
    # Every parameter in bfloat16: the embedding, the head and all 256 experts of each
    # of the 19 expert layers (the footprint counts the table whole, as it is held).
    assert out.weight_bytes == 2 * LLADA2_MINI_PARAMS
    assert out.dtype == "bfloat16" and out.quantize == "none"
    (pool,) = out.pools
    T = pool.prompt_length + pool.gen_length
    assert pool.kv_row_bytes == 2 * cfg.n_layers * T * cfg.n_kv_heads * cfg.head_dim * 2
    assert pool.row_bytes >= pool.kv_row_bytes
    assert out.fits
