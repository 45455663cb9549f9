"""The decode loop itself: batching, compilation, loop equivalence, block discipline,
option validation. Exactness against the public samplers is in test_decoding_exactness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference_samplers import make_model

from asynclane_jax.decoding import SamplerError, driver, generate
from asynclane_jax.decoding.api import build_canvas, make_schedule
from asynclane_jax.models import tiny_llada

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17]]

CASES = [
    ("vanilla", dict(steps=32)),
    ("vanilla", dict(steps=16)),
    ("fast-dllm", dict(cache="none")),
    ("fast-dllm", dict(cache="prefix")),
    ("fast-dllm", dict(cache="dual", threshold=0.95)),
    ("fast-dllm", dict(cache="dual", factor=1.0)),
    ("localleap", dict(cache="dual")),
]


@pytest.mark.parametrize("sampler,opts", CASES)
def test_batch_rows_equal_single_runs(tiny_llada_model, sampler, opts):
    batch = generate(tiny_llada_model, PROMPTS, sampler=sampler, gen_length=32,
                     block_length=8, **opts)
    assert not batch.stats["hit_step_cap"]
    for i, p in enumerate(PROMPTS):
        alone = generate(tiny_llada_model, [p], sampler=sampler, gen_length=32,
                         block_length=8, **opts)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])
        np.testing.assert_array_equal(batch.stats["commit_step"][i],
                                      alone.stats["commit_step"][0])
        assert batch.stats["row_steps"][i] == alone.stats["row_steps"][0]
    mask = tiny_llada_model.cfg.mask_token_id
    assert not np.any(batch.tokens == mask)


@pytest.mark.parametrize("sampler,opts", [("dream", dict(steps=32)),
                                          ("fast-dllm", dict(cache="dual", block_length=8))])
def test_dream_batch_rows_equal_single_runs(sampler, opts):
    # Fixed-count samplers need a less saturated head (no ties at probability 1.0).
    model = make_model("dream", lm_scale=10.0 if sampler == "dream" else 30.0)
    batch = generate(model, PROMPTS, sampler=sampler, gen_length=32, **opts)
    assert not batch.stats["hit_step_cap"]
    for i, p in enumerate(PROMPTS):
        alone = generate(model, [p], sampler=sampler, gen_length=32, **opts)
        np.testing.assert_array_equal(batch.tokens[i], alone.tokens[0])


def test_threshold_commits_several_tokens_per_step(tiny_llada_model):
    res = generate(tiny_llada_model, PROMPTS, sampler="fast-dllm", gen_length=32,
                   block_length=8, cache="dual")
    # Fewer steps than tokens: the sharpened model is confident, so blocks go in parallel.
    assert res.stats["steps"] < 32
    # Rows finish independently: not all rows take the same number of steps.
    assert len(set(res.stats["row_steps"].tolist())) > 1


@pytest.mark.parametrize("sampler,opts", [CASES[0], CASES[4]])
def test_commits_stay_inside_the_current_block(tiny_llada_model, sampler, opts):
    res = generate(tiny_llada_model, PROMPTS, sampler=sampler, gen_length=32,
                   block_length=8, **opts)
    cs = res.stats["commit_step"].reshape(len(PROMPTS), 4, 8)
    assert np.all(cs >= 0)
    # Every commit of block i happens before any commit of block i + 1.
    assert np.all(cs[:, :-1].max(axis=2) < cs[:, 1:].min(axis=2))


def test_one_compilation_per_bucket():
    model = make_model("llada", lm_scale=40.0, seed=3)
    before = driver.TRACE_COUNT["decode"]
    outs = []
    for n in (3, 5, 9, 17, 30):  # all in the default bucket of 32
        prompt = [(7 * i) % 60 for i in range(n)]
        outs.append(generate(model, [prompt, prompt[:2]], sampler="fast-dllm",
                             gen_length=16, block_length=8, cache="dual"))
    assert driver.TRACE_COUNT["decode"] - before == 1
    assert outs[0].stats["compiled"] and not any(o.stats["compiled"] for o in outs[1:])
    # A prompt beyond the bucket compiles once more.
    generate(model, [list(range(1, 40)), [1, 2]], sampler="fast-dllm", gen_length=16,
             block_length=8, cache="dual")
    assert driver.TRACE_COUNT["decode"] - before == 2


@pytest.mark.parametrize("sampler,opts", [CASES[0], CASES[3]])
def test_while_loop_equals_python_loop(tiny_llada_model, sampler, opts):
    cfg = tiny_llada_model.cfg
    schedule = make_schedule(sampler, gen_length=16, block_length=8, **opts)
    canvas, pad_len, _ = build_canvas(PROMPTS, 16, cfg, 32)
    graphdef, params = nnx.split(tiny_llada_model)
    live = jnp.ones((len(PROMPTS),), bool)
    args = (graphdef, params, jnp.asarray(canvas), jnp.asarray(pad_len), live,
            jax.random.key(0))
    final = jax.jit(driver.decode_loop, static_argnums=0,
                    static_argnames=("schedule",))(*args, schedule=schedule)
    state, body, cond = driver.build_loop(*args, schedule=schedule)
    body = jax.jit(body)
    n = 0
    while bool(cond(state)):
        state = body(state)
        n += 1
    assert n == int(final.step)
    np.testing.assert_array_equal(np.asarray(state.canvas), np.asarray(final.canvas))
    np.testing.assert_array_equal(np.asarray(state.commit_step), np.asarray(final.commit_step))
    assert int(state.nfe_full) == int(final.nfe_full)
    assert int(state.nfe_partial) == int(final.nfe_partial)


def test_cached_call_counts(tiny_llada_model):
    res = generate(tiny_llada_model, [PROMPTS[0]], sampler="fast-dllm", gen_length=32,
                   block_length=8, cache="dual")
    # One refresh per block; every other step is a cached call on the block.
    assert res.stats["nfe_full"] == 4
    assert res.stats["nfe_partial"] == res.stats["steps"] - 4
    assert res.stats["tokens_processed"] == 4 * 64 + 8 * res.stats["nfe_partial"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(sampler="nope"), "unknown sampler"),
    (dict(sampler="fast-dllm", threshold=0.0), r"threshold=0.0 must be in \(0, 1\]"),
    (dict(sampler="fast-dllm", threshold=1.5), r"must be in \(0, 1\]"),
    (dict(sampler="fast-dllm", bogus=1), "unknown option"),
    (dict(sampler="fast-dllm", cache="full"), "cache='full'"),
    (dict(sampler="vanilla", block_length=5), "not a multiple of block_length"),
    (dict(sampler="vanilla", block_length=8, steps=6), "multiple of the number of blocks"),
    (dict(sampler="dream", alg="greedy"), "alg='greedy'"),
    (dict(sampler="localleap", relaxed_threshold=0.95), "must not exceed"),
    (dict(sampler="fast-dllm", gen_length=256), "exceeds the model's maximum"),
])
def test_bad_options_are_clear_errors(tiny_llada_model, kwargs, match):
    kwargs = {"gen_length": 32, **kwargs}
    with pytest.raises(SamplerError, match=match):
        generate(tiny_llada_model, [[1, 2, 3]], **kwargs)


def test_bad_prompts_are_clear_errors(tiny_llada_model):
    with pytest.raises(SamplerError, match="prompt 1 is empty"):
        generate(tiny_llada_model, [[1], []], sampler="fast-dllm", gen_length=16)
    with pytest.raises(SamplerError, match="outside"):
        generate(tiny_llada_model, [[1, 999]], sampler="fast-dllm", gen_length=16)
    with pytest.raises(SamplerError, match="list of prompts"):
        generate(tiny_llada_model, [1, 2, 3], sampler="fast-dllm", gen_length=16)


@pytest.mark.parametrize("name", ["llada-8b-instruct", "dream-7b-instruct"])
def test_real_configs_trace_abstractly(name):
    """The 8B / 7B decode loop traces with abstract weights (no memory allocated)."""
    import functools

    from asynclane_jax.models import abstract_model, preset

    graphdef, params = nnx.split(abstract_model(preset(name)))
    schedule = make_schedule("fast-dllm", gen_length=64, block_length=32, cache="dual")
    out = jax.eval_shape(
        functools.partial(driver.decode_loop, graphdef, schedule=schedule), params,
        jax.ShapeDtypeStruct((2, 96), jnp.int32), jax.ShapeDtypeStruct((2,), jnp.int32),
        jax.ShapeDtypeStruct((2,), bool), jax.random.key(0))
    cfg = preset(name)
    assert out.canvas.shape == (2, 96)
    assert out.cache.k.shape == (cfg.n_layers, 2, 96, cfg.n_kv_heads, cfg.head_dim)
    assert out.cache.k.dtype == jnp.bfloat16


def test_mask_token_is_never_committed():
    """A model whose favourite prediction is the mask token still fills the canvas."""
    from asynclane_jax.models import init_model

    cfg = tiny_llada()
    model = init_model(cfg, 5)
    model.lm_head.kernel[...] = model.lm_head.kernel[...].at[:, cfg.mask_token_id].set(5.0)
    for sampler, opts in [("vanilla", {}), ("fast-dllm", {"cache": "dual"})]:
        res = generate(model, PROMPTS[:2], sampler=sampler, gen_length=16, block_length=8,
                       **opts)
        assert not res.stats["hit_step_cap"]
        assert not np.any(res.tokens == cfg.mask_token_id)


def test_batch_buckets_share_one_program_and_pad_rows_cost_no_steps():
    """3 and 4 prompts compile one program (bucket 4); the padding row of the batch of 3
    starts finished: it is never served and never holds back the others."""
    from asynclane_jax.decoding.api import batch_bucket

    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 24]
    model = make_model("llada", lm_scale=40.0, seed=4)
    kw = dict(sampler="fast-dllm", gen_length=16, block_length=8, cache="dual")
    four = generate(model, PROMPTS + [[9, 8, 7]], **kw)
    three = generate(model, PROMPTS, **kw)
    assert four.stats.compiled and not three.stats.compiled
    assert four.stats.compile_time > 0 and three.stats.compile_time == 0.0
    assert three.stats.batch_bucket == 4 and three.tokens.shape == (3, 16)
    np.testing.assert_array_equal(three.tokens, four.tokens[:3])
    assert three.stats.iterations <= four.stats.iterations
    assert three.stats.to_dict()["row_steps"] == four.stats.row_steps[:3].tolist()


def test_key_len_reads_only_the_leading_columns(tiny_llada_model):
    """A cached call with key_len=K equals the same call with the keys from K on masked
    out, and writes the same K/V."""
    model = tiny_llada_model
    b, T, K = 2, 24, 14
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, model.cfg.vocab_size - 2, (b, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (b, T))
    _, cache = model(tokens, return_kv=True)
    q_cols = jnp.asarray([[3, 9, 13, T], [0, 5, 12, 13]], jnp.int32)  # T: an unused slot
    read = jnp.minimum(q_cols, T - 1)
    tq, pq = jnp.take_along_axis(tokens, read, 1), jnp.take_along_axis(pos, read, 1)
    masked = jnp.broadcast_to(jnp.arange(T) < K, (b, T))
    want, want_cache = model.forward(tq, pq, key_mask=masked, cache=cache, write_index=q_cols)
    got, got_cache = model.forward(tq, pq, key_mask=jnp.ones((b, T), bool), cache=cache,
                                   write_index=q_cols, key_len=K)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_cache.k, want_cache.k, atol=1e-6)
    np.testing.assert_allclose(got_cache.v, want_cache.v, atol=1e-6)


def test_dream_entropy_confidence_is_the_public_formula():
    """sum p log(p + 1e-10), not sum p log(max(p, tiny)): the two differ by ~1e-6 over a
    large vocabulary of tiny probabilities (Dream-7B has 152,064 tokens)."""
    from asynclane_jax.decoding.dream import neg_entropy

    V = 152_064
    p = np.full(V, 1e-12, np.float32)
    p[:2] = (1.0 - p[2:].sum()) / 2
    want = np.sum(p.astype(np.float64) * np.log(p.astype(np.float64) + 1e-10))
    old = np.sum(p.astype(np.float64) * np.log(p.astype(np.float64)))
    got = float(neg_entropy(jnp.asarray(p)))
    assert abs(got - want) < 1e-7 < abs(old - want)
