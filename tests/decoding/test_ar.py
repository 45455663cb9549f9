"""The `ar` sampler: greedy autoregressive decoding of a causal model by the one driver.

On a tiny random causal model (Dream-shaped: logit-shifted, grouped-query), `ar`'s
tokens equal a plain-Python greedy loop that runs the model's full causal forward over
the growing sequence and takes the argmax at its last position, token for token, at
batch 3 with prompts of different lengths; batch rows equal single-prompt runs; a row
costs one call over its prompt and one call of one query per later position, fewer
when it ends with an end-of-text; rows admitted into a serving state at different
times (`driver.serve_chunk`) decode the same. A bidirectional model is refused.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.api import build_canvas
from asynclane_jax.decoding.ar import ArSchedule
from asynclane_jax.decoding.schedule import SamplerError
from asynclane_jax.models import init_model, tiny_dream
from asynclane_jax.models.config import ConfigError

jax.config.update("jax_default_matmul_precision", "highest")

G = 12
BUCKET = 16  # every prompt fits one bucket: the batch and the singles share P
PROMPT_LENGTHS = (3, 9, 14)
LM_SCALE = 6.0  # sharpens the random output head: no near ties between the two paths


@partial(jax.jit, static_argnums=0)
def _causal_forward(graphdef, state, tokens, n):
    """The model's full forward over tokens [1, L] with causal attention, the columns
    from n on outside the key mask (the growing sequence is tokens[:, :n])."""
    cols = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    return nnx.merge(graphdef, state)(tokens, key_mask=cols < n, block_ids=cols)


def greedy_reference(model, prompt, gen_length, stop_ids):
    """Greedy decoding, one full causal forward per token over the sequence so far: the
    argmax (never the mask token) at its last position. Returns (the G generated
    tokens, end-of-text filling the rest after a stop; calls made; the smallest gap
    between the best and second-best logit)."""
    cfg = model.cfg
    graphdef, state = nnx.split(model)
    L = BUCKET + gen_length  # one compiled length; the columns past the sequence unseen
    seq, out, gap = list(prompt), [], np.inf
    for _ in range(gen_length):
        tokens = np.full((1, L), cfg.pad_token_id, np.int32)
        tokens[0, :len(seq)] = seq
        logits = np.array(_causal_forward(graphdef, state, jnp.asarray(tokens), len(seq)))
        last = logits[0, len(seq) - 1]
        last[cfg.mask_token_id] = -np.inf
        top2 = np.sort(last)[-2:]
        gap = min(gap, float(top2[1] - top2[0]))
        tok = int(np.argmax(last))
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    calls = len(out)
    return out + [cfg.eos_token_id] * (gen_length - calls), calls, gap


@pytest.fixture(scope="module")
def causal():
    """(model, prompts, reference tokens, reference calls): a random causal tiny model
    whose end-of-text is a token one row produces mid-way and another never does, so
    both endings are exercised."""
    cfg = tiny_dream().replace(causal=True)
    model = init_model(cfg, seed=3)
    model.lm_head.kernel[...] = model.lm_head.kernel[...] * LM_SCALE
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, cfg.vocab_size - 2, n)]
               for n in PROMPT_LENGTHS]
    free = [greedy_reference(model, p, G, ())[0] for p in prompts]
    eos = next((t for t in free[1][3:G - 2] if t not in free[0] and t not in free[1][:3]),
               None)
    assert eos is not None, "no token to serve as end-of-text; change the seeds"
    model.cfg = cfg.replace(eos_token_id=eos)
    refs = [greedy_reference(model, p, G, model.cfg.stop_token_ids) for p in prompts]
    assert min(r[2] for r in refs) > 1e-3, "near ties: sharpen the model"
    calls = [r[1] for r in refs]
    assert calls[0] == G and calls[1] < G, calls  # both endings exercised
    return model, prompts, np.array([r[0] for r in refs]), np.array(calls)


def test_ar_equals_greedy_causal_loop(causal):
    model, prompts, ref, calls = causal
    res = generate(model, prompts, sampler="ar", gen_length=G, bucket=BUCKET)
    np.testing.assert_array_equal(res.tokens, ref)
    st = res.stats
    assert not st.hit_step_cap
    np.testing.assert_array_equal(st.row_nfe_full, 0)
    np.testing.assert_array_equal(st.row_nfe_partial, calls)
    assert st.steps == calls.max()
    # One call over the prompt's P columns, then one query per position.
    shapes = {(s.kind, s.queries): i for i, s in enumerate(st.call_shapes)}
    prompt_call, one = shapes[("cached", BUCKET)], shapes[("cached", 1)]
    np.testing.assert_array_equal(st.row_shape_calls[:, prompt_call], 1)
    np.testing.assert_array_equal(st.row_shape_calls[:, one], calls - 1)
    # Position j is committed by the row's call j.
    committed = np.arange(G)[None, :] < calls[:, None]
    np.testing.assert_array_equal(st.commit_step[committed],
                                  np.broadcast_to(np.arange(G), ref.shape)[committed])

    for i, p in enumerate(prompts):
        one_row = generate(model, [p], sampler="ar", gen_length=G, bucket=BUCKET)
        np.testing.assert_array_equal(one_row.tokens[0], res.tokens[i])
        assert int(one_row.stats.row_nfe_partial[0]) == calls[i]


def test_ar_serves_rows_admitted_at_different_times(causal):
    """Continuous batching: row 0 runs a few calls alone, then rows 1 and 2 join; every
    row decodes as the greedy loop does, with its own call count."""
    model, prompts, ref, calls = causal
    schedule = ArSchedule(gen_length=G).bind(None, model.cfg)
    canvas, pad_len, P = build_canvas(prompts, G, model.cfg, BUCKET)
    graphdef, params = nnx.split(model)
    b = canvas.shape[0]
    chunk = jax.jit(partial(driver.serve_chunk, graphdef, schedule=schedule))
    state = driver.serve_init(graphdef, params, canvas, jax.random.key(0), schedule=schedule)
    for admit, steps in (([True, False, False], 3), ([False, True, True], 10_000)):
        state = chunk(params, state, jnp.asarray(pad_len), jnp.asarray(admit),
                      jnp.asarray(canvas), jnp.zeros((b,), bool), jnp.asarray(steps))
    assert np.all(np.asarray(state.finished))
    np.testing.assert_array_equal(np.asarray(state.canvas)[:, P:], ref)
    np.testing.assert_array_equal(np.asarray(state.row_partial), calls)


def test_ar_refuses_a_bidirectional_model():
    with pytest.raises(SamplerError, match="not causal"):
        ArSchedule(gen_length=8).bind(None, tiny_dream())


def test_causal_config_rules():
    assert not tiny_dream().causal  # a diffusion model unless its config says causal
    with pytest.raises(ConfigError, match="logit_shift"):
        tiny_dream().replace(causal=True, logit_shift=False)
    with pytest.raises(ConfigError, match="block_causal"):
        tiny_dream().replace(causal=True, block_causal=True)


@pytest.mark.slow
def test_the_shipped_ar_model_answers_held_out_problems():
    """tiny-ar-v4, the autoregressive baseline of the v4 models, decodes the first 8
    held-out problems of task set v4 at gen_length 512 with one call per token and
    answers them all (its card: the 500-problem figures)."""
    import asynclane_jax as aj
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    model, tok, cfg = aj.load("tiny-ar-v4")
    assert cfg.causal and cfg.logit_shift and tasks.model_task_set("tiny-ar-v4") == "v4"
    problems = tasks.heldout(8, "v4")
    res = generate(model, ev.prompts_for(problems), sampler="ar", gen_length=512)
    assert not np.any(res.tokens == cfg.mask_token_id)
    assert all(tasks.check(p, row) for p, row in zip(problems, res.tokens))
    # One call per generated token before the end-of-text (the prompt's call commits
    # the first), never more.
    lengths = np.argmax(np.asarray(res.tokens) == cfg.eos_token_id, axis=1) + 1
    np.testing.assert_array_equal(res.stats.row_steps, lengths)
