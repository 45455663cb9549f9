"""The block samplers on AsyncLane's footing: the cascade as an option of BlockSchedule
(block.py). The bench's comparisons that use them are tested in
tests/commands/test_bench_compare.py.

- The cascade on hand-made logits: an end-of-text committed mid-block ends the row at
  once.
- Validation and the registry's options.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from asynclane_jax.decoding.registry import build, get_schedule_class, option_docs, option_fields
from asynclane_jax.decoding.schedule import CallOutput, Context, SamplerError

# ------------------------------------------------------------ hand-made logits

V, MASK, EOS, P = 8, 7, 6, 4


def confident_table(G, eos_at=None, unsure=()):
    """[G, V] logits predicting each generated position, whatever the call: token 1 at
    probability ~0.998, the end-of-text at eos_at more confident still, and at the
    `unsure` positions token 2 at ~0.28 (below every threshold), a little less confident
    the later they are."""
    j = np.arange(G)
    logits = np.zeros((G, V), np.float32)
    logits[:, MASK] = -1e9
    logits[:, 1] = 8.0
    if eos_at is not None:
        logits[eos_at, [1, EOS]] = 0.0, 12.0
    low = np.isin(j, unsure)
    logits[low, 1] = 0.0
    logits[low, 2] = 1.0 - 0.001 * j[low]
    return logits


def make_ctx(G):
    return Context(batch=1, prompt_len=P, gen_length=G, shift=0, mask_id=MASK, eos_id=EOS,
                   stop_ids=(EOS,), pad_len=jnp.zeros((1,), jnp.int32))


def drive(schedule, table):
    """Runs a schedule by hand (batch 1, no logit shift) with logits from `table`
    whatever it queries; returns (generated tokens, the plans made)."""
    G = schedule.gen_length
    T = P + G
    ctx = make_ctx(G)
    by_column = jnp.asarray(np.concatenate([np.zeros((P, V), np.float32), table]))
    canvas = jnp.concatenate([jnp.zeros((1, P), jnp.int32),
                              jnp.full((1, G), MASK, jnp.int32)], axis=1)
    state, live, plans = schedule.init(ctx), jnp.ones((1,), bool), []
    # Eagerly: a few dozen small steps cost less than compiling them.
    update = lambda *a: schedule.update(ctx, *a)  # noqa: E731
    plan = lambda *a: schedule.plan(ctx, *a)  # noqa: E731
    while not bool(schedule.done(ctx, canvas, state)[0]):
        assert len(plans) < schedule.max_iterations()
        p = plan(canvas, state, live)
        plans.append(p)
        out = CallOutput(logits=by_column[jnp.minimum(p.positions, T - 1)],
                         targets=p.positions, serve=p.serve & live, full=p.full)
        canvas, state = update(canvas, state, out, jax.random.PRNGKey(0))
    return np.asarray(canvas[0, P:]), plans


@pytest.mark.parametrize("sampler,opts", [
    ("fast-dllm", dict(cache="dual")), ("localleap", dict(cache="prefix")),
    ("vanilla", dict(steps=8)),
])
def test_the_cascade_ends_the_row_mid_block(sampler, opts):
    # An end-of-text at position 5 of the first block, three unsure positions after it.
    G, e = 64, 5
    table = confident_table(G, eos_at=e, unsure=[6, 7, 8])
    calls = {}
    for mode in ("published", "early_stop", "cascade"):
        flags = {"early_stop": mode == "early_stop", "cascade": mode == "cascade"}
        tokens, plans = drive(build(sampler, gen_length=G, **opts, **flags), table)
        calls[mode] = len(plans)
        assert np.all(tokens[:e] == 1) and tokens[e] == EOS
        if mode == "cascade":  # at once, mid-block
            assert np.all(tokens[e + 1:] == EOS)
        elif mode == "early_stop":  # once the block is finished
            assert np.all(tokens[6:9] == 2) and np.all(tokens[32:] == EOS)
    if sampler == "vanilla":  # 8 commits a step: the end-of-text and 0..4 in the first
        assert calls == {"published": 8, "early_stop": 4, "cascade": 1}
    else:  # the first call commits all but the unsure three, then one a call
        assert calls == {"published": 5, "early_stop": 4, "cascade": 1}


# ------------------------------------------------------------ options and validation

@pytest.mark.parametrize("opts,needle", [
    (dict(sampler="localleap", cascade="yes"), "cascade='yes' must be true or false"),
    # Renewal calls were an option of the dual-cache samplers, removed (docs/asynclane.md).
    (dict(sampler="fast-dllm", cache="dual", renew=256), "unknown option"),
    (dict(sampler="vanilla", renew=8), "unknown option"),
])
def test_bad_options_are_refused_in_one_line(opts, needle):
    with pytest.raises(SamplerError, match=needle) as err:
        build(opts.pop("sampler"), gen_length=128, **opts)
    assert "\n" not in str(err.value)


def test_options_off_by_default_and_documented():
    for name in ("fast-dllm", "localleap"):
        cls = get_schedule_class(name)
        fields, docs = option_fields(cls), option_docs(cls)
        assert fields["cascade"].default is False and fields["early_stop"].default is False
        assert {"cascade", "early_stop"} <= set(docs)
    # The fixed-step samplers take the cascade too.
    for name in ("vanilla", "dream"):
        assert "cascade" in option_fields(get_schedule_class(name))
