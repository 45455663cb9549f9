"""Traced options (`Schedule.traced_options`): thresholds are per-row arguments of the
compiled program, not constants of it. Schedules that differ only in them share one
program; a value decodes exactly as the published restatement does; and rows at
different values in one batch each decode as they would alone at their own value."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference_samplers import LM_SCALE_THRESHOLD, fast_dllm, make_model, make_prompts

from asynclane_jax.decoding import driver, generate, registry
from asynclane_jax.decoding.api import build_canvas
from asynclane_jax.decoding.asynclane import AsyncLaneSchedule
from asynclane_jax.decoding.fast_dllm import FastDllmSchedule
from asynclane_jax.decoding.localleap import LocalLeapSchedule
from asynclane_jax.decoding.schedule import Context, SamplerError

GEN = 32


def test_traced_options_leave_the_structure_and_stay_checked_on_the_host():
    a = FastDllmSchedule(gen_length=GEN, threshold=0.81, cache="dual")
    b = FastDllmSchedule(gen_length=GEN, threshold=0.811, cache="dual")
    assert a != b and a.structure() == b.structure()
    assert hash(a.structure()) == hash(b.structure())
    assert a.structure().threshold == 0.9  # the field default, a placeholder
    assert a.structure() != FastDllmSchedule(gen_length=GEN, threshold=0.81).structure()
    assert a.traced_values() == {"threshold": 0.81}
    assert LocalLeapSchedule(gen_length=GEN).traced_values() == {
        "threshold": 0.9, "relaxed_threshold": 0.75}
    lane = AsyncLaneSchedule(gen_length=GEN, threshold=0.7, delimiters="none")
    assert lane.structure() == AsyncLaneSchedule(gen_length=GEN, delimiters="none")
    # A schedule with none is its own structure.
    vanilla = registry.build("vanilla", gen_length=8)
    assert vanilla.traced_options == () and vanilla.structure() is vanilla
    for bad in ({"threshold": 0.0}, {"threshold": 1.5}):
        with pytest.raises(SamplerError, match="threshold"):
            FastDllmSchedule(gen_length=GEN, **bad)
    with pytest.raises(SamplerError, match="must not exceed"):
        LocalLeapSchedule(gen_length=GEN, threshold=0.8, relaxed_threshold=0.85)
    # Inside a trace: the argument when given, else the schedule's own value.
    ctx = Context(batch=2, prompt_len=1, gen_length=GEN, shift=0, mask_id=0, eos_id=1,
                  stop_ids=(1,), pad_len=jnp.zeros((2,), jnp.int32))
    np.testing.assert_array_equal(a.row_option(ctx, "threshold"), np.float32([0.81] * 2))
    rows = jnp.asarray([0.5, 0.7], jnp.float32)
    ctx = dataclasses.replace(ctx, traced={"threshold": rows})
    np.testing.assert_array_equal(a.row_option(ctx, "threshold"), rows)


def test_fast_dllm_thresholds_share_one_program_and_match_the_reference():
    """Three thresholds, one compiled program; at 0.8 the tokens, commit steps and calls
    are the published restatement's, row by row."""
    model = make_model("llada", lm_scale=LM_SCALE_THRESHOLD["llada"])
    prompts = make_prompts(model.cfg.vocab_size)
    opts = dict(sampler="fast-dllm", gen_length=GEN, block_length=8, cache="dual")
    traces = driver.TRACE_COUNT["decode"]
    runs = {t: generate(model, prompts, threshold=t, **opts) for t in (0.5, 0.8, 0.95)}
    assert driver.TRACE_COUNT["decode"] - traces <= 1
    assert not runs[0.8].stats.compiled and not runs[0.95].stats.compiled
    assert len({r.stats.nfe for r in runs.values()}) == 3  # the values reach the program
    for i, p in enumerate(prompts):
        tokens, info = fast_dllm(model, p, gen_length=GEN, block_length=8, threshold=0.8,
                                 cache="dual")
        np.testing.assert_array_equal(runs[0.8].tokens[i], tokens, err_msg=f"row {i}")
        assert runs[0.8].stats.row_nfe_partial[i] == info["nfe_partial"]
        assert runs[0.8].stats.row_nfe_full[i] == info["nfe_full"]


def _d2f_model():
    model = nnx.clone(make_model("llada", lm_scale=LM_SCALE_THRESHOLD["llada"]))
    model.cfg = model.cfg.replace(block_causal=True)
    return model


# sampler, options, two settings of its traced options.
CASES = [
    ("fast-dllm", dict(block_length=8, cache="dual"), dict(threshold=0.6),
     dict(threshold=0.95)),
    ("localleap", dict(block_length=8, cache="prefix"),
     dict(threshold=0.9, relaxed_threshold=0.5), dict(threshold=0.97, relaxed_threshold=0.9)),
    ("asynclane", dict(block_length=8, delimiters="even"),  # forks at every even id
     dict(threshold=0.6, stable_fraction=0.2), dict(threshold=0.97, stable_fraction=0.9)),
    ("d2f", dict(block_length=8, max_active_blocks=2),
     dict(skip_threshold=0.5, block_add_threshold=0.1, decoded_token_threshold=0.5),
     dict(skip_threshold=0.95, block_add_threshold=0.6, decoded_token_threshold=0.95)),
]


@pytest.mark.parametrize("sampler,options,one,two", CASES, ids=[c[0] for c in CASES])
def test_rows_at_different_values_decode_as_alone(sampler, options, one, two):
    """One batch whose rows carry different values of the traced options (as a server's
    requests do): each row's tokens are those it gets in a batch all at its value."""
    model = _d2f_model() if sampler == "d2f" else make_model(
        "llada", lm_scale=LM_SCALE_THRESHOLD["llada"])
    prompts = make_prompts(model.cfg.vocab_size)
    if options.get("delimiters") == "even":
        even = range(0, model.cfg.vocab_size - 2, 2)
        options = {**options, "delimiters": ",".join(map(str, even))}
    alone = [generate(model, prompts, sampler=sampler, gen_length=GEN, bucket=1,
                      pad_batch=False, **options, **kw) for kw in (one, two)]
    assert not alone[1].stats.compiled
    assert (alone[0].stats.nfe != alone[1].stats.nfe
            or not np.array_equal(alone[0].tokens, alone[1].tokens))
    if sampler == "asynclane":  # the forks, where stable_fraction is read
        assert alone[0].stats.forks.sum() > 0 and alone[1].stats.forks.sum() > 0

    # The program `generate` compiled, called with each row at its own setting.
    schedule = registry.build(sampler, gen_length=GEN, **options, **one).bind(None, model.cfg)
    canvas, pad_len, P = build_canvas(prompts, GEN, model.cfg, 1)
    graphdef, params = nnx.split(model)
    args = (params, jnp.asarray(canvas), jnp.asarray(pad_len), jnp.ones(3, bool),
            jax.random.key(0), schedule.operands())
    exe, compiled = driver.compiled_decode(graphdef, *args, schedule=schedule)
    assert not compiled
    pick = [0, 1, 0]  # the setting of each row
    traced = {n: jnp.asarray([(one, two)[k][n] for k in pick], jnp.float32)
              for n in schedule.traced_options}
    mixed = np.asarray(exe.program(*args, traced).canvas)[:, P:]
    for i, k in enumerate(pick):
        np.testing.assert_array_equal(mixed[i], alone[k].tokens[i], err_msg=f"row {i}")
