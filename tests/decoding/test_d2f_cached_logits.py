"""D2F's cached decode path computes what the block-causal model computes.

Along a real decode (`generate` with the `d2f` sampler: the driver's compiled loop, the
block cache, several blocks in flight), every call's logits are recorded and compared
with one block-causal full forward of the canvas that call read (the same positions,
padding mask and block ids). They must agree to float32 rounding at every queried
position, including the generated positions past 256, for a LLaDA-style and a
Dream-style (logit-shifted, grouped-query) model. If they did not, a long answer could
be lost by the decoder rather than by the student.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference_samplers import make_prompts

from asynclane_jax.decoding import generate
from asynclane_jax.decoding.d2f import D2FSchedule
from asynclane_jax.models import init_model, tiny_dream, tiny_llada

GEN, BLOCK = 384, 32
FAR = 256  # generated positions from here on are the ones the long answers need
TOL = 1e-5

_calls: list[dict] = []


def _record(canvas, logits, targets, serve):
    _calls.append({"canvas": np.asarray(canvas), "logits": np.asarray(logits),
                   "targets": np.asarray(targets), "serve": np.asarray(serve)})


@dataclasses.dataclass(frozen=True)
class RecordingD2F(D2FSchedule):
    """d2f that hands each call's canvas and logits to `_record` before its update;
    with no_eos, the update never sees end-of-text as a choice (the recorded logits are
    the call's own)."""

    no_eos: bool = False

    def update(self, ctx, canvas, state, out, key):
        jax.debug.callback(_record, canvas, out.logits, out.targets, out.serve)
        if self.no_eos:
            out = out.replace(logits=out.logits.at[..., ctx.eos_id].set(-jnp.inf))
        return super().update(ctx, canvas, state, out, key)


def _student(family: str, lm_scale: float):
    """A random block-causal tiny model long enough for GEN, sharpened so that the
    pipeline keeps several blocks in flight, and never choosing end-of-text (so every
    row decodes all GEN positions)."""
    cfg = {"llada": tiny_llada, "dream": tiny_dream}[family]()
    cfg = cfg.replace(max_seq_len=512, block_causal=True)
    model = init_model(cfg, 3)
    head = np.array(model.lm_head.kernel[...]) * lm_scale
    head[:, [cfg.mask_token_id, cfg.eos_token_id]] = 0.0
    model.lm_head.kernel[...] = jnp.asarray(head)
    for layer in model.layers:
        for proj in (layer.attn.q_proj, layer.attn.k_proj):
            proj.kernel[...] = proj.kernel[...] * 4.0
    return model


@partial(jax.jit, static_argnums=0)
def _full(graphdef, state, canvas, positions, key_mask, ids):
    return nnx.merge(graphdef, state)(canvas, positions=positions, key_mask=key_mask,
                                      block_ids=ids)


def _block_causal_full(model, canvas, pad_len, P):
    """Logits [b, T, V] of one block-causal full forward of the canvas, laid out as the
    driver lays out a call (positions from each row's first prompt token, padding keys
    masked, the prompt block 0, generated block k block k + 1)."""
    b, T = canvas.shape
    cols = np.arange(T)[None, :]
    positions = np.maximum(cols - pad_len[:, None], 0)
    key_mask = cols >= pad_len[:, None]
    ids = np.where(cols < P, 0, (cols - P) // BLOCK + 1)
    graphdef, state = nnx.split(model)
    return np.asarray(_full(graphdef, state, jnp.asarray(canvas),
                            jnp.asarray(positions, jnp.int32), jnp.asarray(key_mask),
                            jnp.asarray(np.broadcast_to(ids, (b, T)), jnp.int32)))


@pytest.mark.parametrize("family, lm_scale", [("llada", 6.0), ("dream", 6.0)])
def test_every_cached_call_equals_a_block_causal_full_forward(family, lm_scale):
    model = _student(family, lm_scale)
    shift = int(model.cfg.logit_shift)
    prompts = make_prompts(model.cfg.vocab_size, lengths=(5, 11))
    sched = RecordingD2F(gen_length=GEN, block_length=BLOCK, max_active_blocks=4)
    _calls.clear()
    res = generate(model, prompts, sampler=sched, pad_batch=False)
    jax.effects_barrier()
    calls = list(_calls)
    assert res.stats.nfe_full == 0 and len(calls) == res.stats.nfe_partial
    assert not np.any(res.tokens == model.cfg.mask_token_id)
    P = calls[0]["canvas"].shape[1] - GEN
    pad_len = np.asarray([P - len(p) for p in prompts])
    worst, far_checked = 0.0, 0
    several_in_flight = 0
    for c in calls:
        full = _block_causal_full(model, c["canvas"], pad_len, P)
        T = full.shape[1]
        valid = (c["targets"] < T) & c["serve"][:, None]
        rows, q = np.nonzero(valid)
        read = c["targets"][rows, q] - shift  # the column whose output predicts the target
        diff = np.abs(c["logits"][rows, q] - full[rows, read]).max(axis=-1)
        worst = max(worst, float(diff.max(initial=0.0)))
        far = c["targets"][rows, q] - P >= FAR
        far_checked += int(far.sum())
        tgt = c["targets"][rows, q]
        masked = (tgt >= P) & (c["canvas"][rows, np.minimum(tgt, T - 1)]
                               == model.cfg.mask_token_id)
        blocks_with_masks = {(r, (t - P) // BLOCK) for r, t in zip(rows[masked], tgt[masked])}
        if len(blocks_with_masks) > len({r for r, _ in blocks_with_masks}):
            several_in_flight += 1
        assert diff.max(initial=0.0) <= TOL, (
            f"{family}: call over targets {c['targets'][0, :3]}...: max |cached - full| "
            f"{diff.max():.2e}")
    assert far_checked > 0, "no call predicted a generated position past 256"
    assert several_in_flight > 0, "the decode never had two blocks with masks in flight"
    print(f"{family}: {len(calls)} calls, max |cached - full| {worst:.2e}, "
          f"{far_checked} predictions past position {FAR} checked")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada-v4b-d2f", "tiny-dream-v4-d2f"])
def test_the_shipped_students_cached_calls_equal_their_full_forwards(name):
    """The same check on a shipped v4 student decoding two long held-out problems
    (reference answers over 256 tokens) at gen_length 512 with d2f's defaults. The
    students end most long answers early, so here the schedule never commits
    end-of-text (`no_eos`) and every row decodes all 512 positions. The bound is
    relative to the logits' size (they reach about 25): float32 rounding differs with
    the order of the sums (an eager full forward, op by op, differs from the compiled
    one by more than 1e-5), and six layers of it stay near 1e-6 of the logits."""
    import asynclane_jax as aj
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    model = aj.load(name)[0]
    shift = int(model.cfg.logit_shift)
    long = [p for p in tasks.heldout(60, tasks.model_task_set(name))
            if tasks.answer_tokens(p) > FAR][:2]
    prompts = ev.prompts_for(long)
    _calls.clear()
    generate(model, prompts, sampler=RecordingD2F(gen_length=512, no_eos=True),
             pad_batch=False)
    jax.effects_barrier()
    calls = list(_calls)
    P = calls[0]["canvas"].shape[1] - 512
    pad_len = np.asarray([P - len(p) for p in prompts])
    worst, far, scale = 0.0, 0, 0.0
    for c in calls:
        full = _block_causal_full(model, c["canvas"], pad_len, P)
        T = full.shape[1]
        rows, q = np.nonzero((c["targets"] < T) & c["serve"][:, None])
        got, want = c["logits"][rows, q], full[rows, c["targets"][rows, q] - shift]
        worst = max(worst, float(np.abs(got - want).max(initial=0.0)))
        scale = max(scale, float(np.abs(want).max(initial=0.0)))
        far += int(np.sum(c["targets"][rows, q] - P >= FAR))
    print(f"{name}: {len(calls)} calls, max |cached - full| {worst:.2e} (logits up to "
          f"{scale:.1f}), {far} predictions past position {FAR}")
    assert far > 0 and worst <= 1e-5 * max(scale, 1.0)
