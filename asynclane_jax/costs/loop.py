"""The decode's own work between model calls, measured on this machine.

Each iteration of the decode loop plans a call, makes it, and lets the schedule commit
from the logits (decoding/driver.py). The measured "cpu" chip (`measure.MeasuredCosts`)
prices the calls; what a schedule does around them (planning, ranking confidences, a
learned router, the lanes' bookkeeping) is not a model call and must be priced apart.

`loop_overhead` measures it with the model's layers taken out: the same schedule decodes
the same prompts with a copy of the model that keeps only the embedding, the final norm
and the output head (`without_layers`), so its calls cost little and each iteration's
time is mostly the loop's own. What those light calls still cost is measured per shape
and taken away; what is left, per model call, is the overhead. The layerless model
commits different tokens (its logits are not the trained model's) and so may take a
different number of iterations, but each iteration does the same work on arrays of the
same shapes.
"""

from __future__ import annotations

import copy

import jax
from flax import nnx

from asynclane_jax.costs.measure import MeasuredCosts


def without_layers(model):
    """A copy of `model` with no transformer layers: the embedding, the final norm and
    the output head (or the tied embedding) are the model's own."""
    from asynclane_jax.models.model import DiffusionLM

    # A config may not ask for no layers (ModelConfig checks n_layers > 0); this copy
    # only ever builds the layerless measuring model.
    cfg = copy.copy(model.cfg)
    object.__setattr__(cfg, "n_layers", 0)
    bare = nnx.eval_shape(lambda: DiffusionLM(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model)
    keep = nnx.state(bare)
    merged = jax.tree.map(lambda _, x: x, keep, _select(state, keep))
    nnx.update(bare, merged)
    return bare


def _select(state, like):
    """The entries of `state` at the paths `like` has (the layerless model's)."""
    flat = dict(nnx.to_flat_state(state))
    return nnx.from_flat_state({path: flat[path] for path, _ in nnx.to_flat_state(like)})


def loop_overhead(model, prompts, *, sampler, gen_length, bucket=None, tokenizer=None,
                  repeat: int = 1, **options) -> float:
    """Seconds per model call that a decode of `sampler` spends outside its calls on
    this machine (see the module docstring).

    Args:
      model: the model whose decodes are priced (its layers are taken out here).
      prompts: token-id lists, decoded in one batch as the bench does.
      sampler, gen_length, bucket, tokenizer, options: as `generate`.
      repeat: timed decodes after the one that compiles.
    """
    from asynclane_jax.decoding.api import generate, make_schedule

    bare = without_layers(model)
    # Bound for the model itself (a schedule's learned weights are found by its config).
    schedule = make_schedule(sampler, gen_length=gen_length, **options).bind(tokenizer,
                                                                              model.cfg)
    kw = dict(sampler=schedule, tokenizer=tokenizer)
    if bucket is not None:
        kw["bucket"] = bucket
    generate(bare, prompts, **kw)  # compiles
    costs = MeasuredCosts(bare)
    total = calls_time = 0.0
    calls = 0
    for _ in range(max(1, int(repeat))):
        st = generate(bare, prompts, **kw).stats
        total += st.decode_time
        for shape, n in zip(st.call_shapes, st.shape_calls):
            calls += int(n)
            calls_time += int(n) * costs.call_time(shape)
    return max(0.0, total - calls_time) / max(calls, 1)


__all__ = ["loop_overhead", "without_layers"]
