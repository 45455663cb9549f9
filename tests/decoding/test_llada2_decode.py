"""LLaDA2.0's block-diffusion sampler (`llada2`): token for token against a plain-Python
restatement of the published generation loop (inclusionAI LLaDA2.0, `generate`), on a
tiny random LLaDA2 model, rows of one batch equal to the prompts decoded alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_samplers import _full_blocks, _Margins, make_prompts, runner, softmax

from asynclane_jax.decoding import driver, generate
from asynclane_jax.decoding.llada2 import LLaDA2Schedule
from asynclane_jax.decoding.schedule import SamplerError
from asynclane_jax.models import init_model, preset

jax.config.update("jax_default_matmul_precision", "highest")

_MODEL: dict = {}


def tiny_llada2(lm_scale=30.0, qk_scale=4.0, eos_as=None):
    """A (memoised) tiny random LLaDA2 model in float32, sharpened as the other samplers'
    test models are (reference_samplers.make_model): the QK-norm scales (the q/k kernels
    would be normalised away) and the output head; the mask column zeroed. `eos_as`: a
    token whose output column trades places with end-of-text's, so that end-of-text is
    predicted where that (often predicted) token was."""
    key = (lm_scale, qk_scale, eos_as)
    if key not in _MODEL:
        cfg = preset("tiny-llada2-test").replace(dtype="float32", param_dtype="float32")
        model = init_model(cfg, 0)
        head = np.array(model.lm_head.kernel[...]) * lm_scale
        head[:, cfg.mask_token_id] = 0.0
        if eos_as is not None:
            e = cfg.eos_token_id
            head[:, [e, eos_as]] = head[:, [eos_as, e]]
        model.lm_head.kernel[...] = jnp.asarray(head)
        for layer in model.layers:
            for norm in (layer.attn.q_norm, layer.attn.k_norm):
                norm.scale[...] = norm.scale[...] * qk_scale
        _MODEL[key] = model
    return _MODEL[key]


def llada2_reference(model, prompt, *, gen_length, block_length, steps, threshold,
                     minimal_topk=1, eos_early_stop=False, editing_threshold=None,
                     max_post_steps=0, cut=False):
    """The published LLaDA2.0 `generate`, greedy, restated for one prompt.

    The canvas is the prompt and masks up to the end of the block holding generated
    position gen_length - 1 (blocks from the prompt's first token); `cut` ends it at
    P + gen_length instead (what the engine's canvas holds). Each block from the one
    holding the first generated position: at most min(steps, gen_length // minimal_topk)
    steps, leaving early once it has no masks; a step is one forward over the canvas up
    to the block's end, block-causal; confidence = softmax probability of the argmax;
    if at least n_i masked confidences exceed the threshold they all commit, else the
    min(n_i, masks) most confident. After a block, an end-of-text in the generated part
    stops. eos_early_stop: a step committing an end-of-text stops when no mask precedes
    the first end-of-text. The answer ends at its first end-of-text; returned here
    padded to gen_length with end-of-text.

    LLaDA2.1's editing (`editing_threshold` not None), as its public ports describe it:
    in every call on a block, a decoded, non-prompt position of the block whose argmax
    differs from its token with probability above editing_threshold takes the argmax;
    once the block has no masks, up to max_post_steps more calls are made, ending after
    the first that edits nothing. The top-k step counter advances only on calls that
    found masks.
    """
    cfg = model.cfg
    mask, eos, B, G = cfg.mask_token_id, cfg.eos_token_id, block_length, gen_length
    P = len(prompt)
    n_blocks = -(-(P + G) // B)
    L = P + G if cut else n_blocks * B
    x = np.array(list(prompt) + [mask] * (L - P), np.int64)
    s_eff = min(steps, G // minimal_topk)
    base, rem = divmod(B, s_eff)
    counts = [base + (i < rem) for i in range(s_eff)]
    r = runner(model)
    margins = _Margins()
    commit_step = np.full(L - P, -1, np.int64)
    calls = 0
    paths = {"threshold": 0, "topk": 0, "edits": 0, "post": 0, "quiet": 0, "capped": 0,
             "early_stop": 0}
    editing = editing_threshold is not None

    def answer():
        gen = x[P:P + G].copy()
        hits = np.flatnonzero(gen == eos)
        if len(hits):
            gen[hits[0] + 1:] = eos
        return gen

    for k in range(P // B, n_blocks):
        start, end = k * B, min((k + 1) * B, L)
        ids = np.arange(L) // B
        is_prompt = np.arange(start, end) < P
        i, post = 0, 0
        while i < s_eff or (editing and post <= max_post_steps):
            active = x[start:end] == mask
            remaining = bool(active.any())
            if not remaining and not editing:
                break
            if not remaining:
                post += 1
                if post > max_post_steps:
                    paths["capped"] += 1
                    break
            # The whole canvas, block-causal: the blocks after this one are invisible
            # to it, so this is the published forward over the canvas up to its end
            # (one compiled shape per prompt instead of one per block).
            logits = np.asarray(_full_blocks(r.graphdef, r.state,
                                             jnp.asarray(x, jnp.int32)[None],
                                             jnp.asarray(ids, jnp.int32)[None])[0])[start:end]
            p = softmax(logits, np.float32)
            x0 = p.argmax(-1)
            conf = np.where(active, p.max(-1), -np.inf)
            sel = np.zeros(0, np.int64)
            if remaining and i < s_eff:
                n = counts[i]
                high = conf > threshold
                for c in conf[active]:
                    margins.conf_gap(c - threshold)
                if high.sum() >= n:
                    sel = np.flatnonzero(high)
                    paths["threshold"] += int(len(sel) > 0)
                else:
                    m = min(n, int(active.sum()))
                    order = np.argsort(-conf, kind="stable")
                    sel = order[:m]
                    paths["topk"] += 1
                    if m < active.sum():
                        margins.conf_gap(conf[order[m - 1]] - conf[order[m]])
                commit_step[start + sel - P] = calls
            edits = np.zeros(0, np.int64)
            if editing:
                editable = ~active & ~is_prompt
                pe = p.max(-1)
                for j in np.flatnonzero(editable & (x0 != x[start:end])):
                    margins.conf_gap(pe[j] - editing_threshold)
                edits = np.flatnonzero(editable & (pe > editing_threshold)
                                       & (x0 != x[start:end]))
                paths["edits"] += len(edits)
                paths["post"] += int(not remaining)
            sel = np.concatenate([sel, edits])
            margins.argmax_gap(logits[sel])
            x[start + sel] = x0[sel]
            calls += 1
            if not remaining and not len(edits):
                paths["quiet"] += 1
                break
            i += int(remaining)
            if eos_early_stop and np.any(x0[sel] == eos):
                first = int(np.flatnonzero(x == eos)[0])
                if np.all(x[P:first] != mask):
                    paths["early_stop"] += 1
                    return answer(), dict(calls=calls, commit_step=commit_step[:G],
                                          margins=margins, paths=paths)
        if np.any(x[P:end] == eos):
            break
    return answer(), dict(calls=calls, commit_step=commit_step[:G], margins=margins,
                          paths=paths)


def _check(model, prompts, *, cut, **kw):
    res = generate(model, prompts, sampler="llada2", **kw)
    G = kw["gen_length"]
    ref_kw = {k: v for k, v in kw.items() if k != "gen_length"}
    paths = {}
    for i, p in enumerate(prompts):
        tokens, info = llada2_reference(model, p, gen_length=G, cut=cut, **ref_kw)
        assert info["margins"].logit > 1e-4 and info["margins"].conf > 1e-5, (i, kw)
        np.testing.assert_array_equal(res.tokens[i], tokens, err_msg=f"{kw} row {i}")
        assert res.stats.row_nfe_full[i] == 1
        assert res.stats.row_nfe_full[i] + res.stats.row_nfe_partial[i] == info["calls"]
        upto = np.flatnonzero(tokens == model.cfg.eos_token_id)
        upto = upto[0] + 1 if len(upto) else G
        np.testing.assert_array_equal(res.stats.commit_step[i][:upto],
                                      info["commit_step"][:upto], err_msg=f"{kw} row {i}")
        for key, n in info["paths"].items():
            paths[key] = paths.get(key, 0) + n
    assert not np.any(res.tokens == model.cfg.mask_token_id)
    assert not res.stats.hit_step_cap
    return res, paths


# Rows 0 and 1 end on a block boundary (P_row + 27 a multiple of 8), so the engine's
# canvas holds their whole last block: they must equal the published loop itself. Rows 2
# and 3 do not: they equal the loop on the canvas cut at P + gen_length (llada2.py).
# Row 3's prompt is one whole block: its first generated block starts a block.
LENGTHS = (5, 13, 14, 8)
KW = dict(gen_length=27, block_length=8, steps=4)


def _run(model, *, published_rows=(0, 1), **kw):
    prompts = make_prompts(model.cfg.vocab_size, lengths=LENGTHS)
    for i in published_rows:
        full, _ = llada2_reference(model, prompts[i], cut=False, **KW, **kw)
        cut, _ = llada2_reference(model, prompts[i], cut=True, **KW, **kw)
        np.testing.assert_array_equal(full, cut)
    return _check(model, prompts, cut=True, **KW, **kw)


def test_equals_the_published_loop():
    """Two top-k positions per step (8 positions, 4 steps), the threshold path and the
    top-k path both taken, the prompt's last block holding generated positions; the two
    thresholds share one compiled program (a traced option)."""
    model = tiny_llada2(lm_scale=60.0)
    traced = []
    for threshold in (0.9, 0.7):
        _, paths = _run(model, threshold=threshold)
        assert paths["threshold"] >= 5 and paths["topk"] >= 5, (threshold, paths)
        traced.append(driver.TRACE_COUNT["decode"])
    assert traced[1] == traced[0]


@pytest.mark.parametrize("editing", [False, True])
def test_end_of_text(editing):
    """A model that often predicts end-of-text: the row stops after the block holding
    it (LLaDA2.0), or at once with eos_early_stop (with editing); its answer ends
    there."""
    model = tiny_llada2(lm_scale=60.0, eos_as=EOS_AS)
    res, paths = _run(model, threshold=0.9, **(EDITING if editing else {}))
    assert paths["early_stop"] >= (1 if editing else 0), paths
    eos = model.cfg.eos_token_id
    stopped = [np.any(row == eos) for row in res.tokens]
    assert sum(stopped) >= 2, res.tokens


# LLaDA2.1's token editing, with eos_early_stop (one compiled program for both tests).
EDITING = dict(editing_threshold=0.95, max_post_steps=4, eos_early_stop=True)


def test_token_editing():
    """LLaDA2.1's editing: decoded positions replaced, extra calls after a block's last
    mask, blocks ending both at max_post_steps and on a call that edits nothing."""
    _, paths = _run(tiny_llada2(lm_scale=60.0), threshold=0.7, **EDITING)
    assert paths["edits"] >= 10 and paths["quiet"] >= 2 and paths["capped"] >= 2, paths


EOS_AS = 41  # rows 1 and 2 of LENGTHS stop; eos_early_stop saves row 2 calls


def test_bad_options():
    for kw, match in [({"block_length": 0}, "block_length"), ({"steps": 0}, "steps"),
                      ({"threshold": 0.0}, "threshold"), ({"minimal_topk": 0}, "minimal"),
                      ({"eos_early_stop": "yes"}, "eos_early_stop"),
                      ({"editing_threshold": 1.5}, "editing_threshold"),
                      ({"max_post_steps": -1}, "max_post_steps")]:
        with pytest.raises(SamplerError, match=match):
            LLaDA2Schedule(gen_length=8, **kw)
    assert LLaDA2Schedule(gen_length=8, steps=32, minimal_topk=2).steps_per_block == 4


# ---------------------------------------------------------------- rules on hand-made logits

def _hand(sched, canvas, state, picks, V=10):
    """One update of `sched` on a batch-1 canvas (prompt of 6, gen_length 6, blocks of
    4: the prompt's last block holds columns 4-7, generated ones 6 and 7), with logits
    for the current block: `picks` maps a column to (token, probability), every other
    column flat."""
    from asynclane_jax.decoding.schedule import CallOutput, Context

    ctx = Context(batch=1, prompt_len=6, gen_length=6, shift=0, mask_id=9, eos_id=8,
                  stop_ids=(8,), pad_len=jnp.zeros((1,), jnp.int32))
    cols = 4 * int(state.block[0]) + np.arange(4)
    probs = np.full((1, 4, V), 1.0 / V)
    for c, (tok, p) in picks.items():
        probs[0, c - cols[0]] = (1 - p) / (V - 1)
        probs[0, c - cols[0], tok] = p
    out = CallOutput(logits=jnp.log(jnp.asarray(probs, jnp.float32)),
                     targets=jnp.asarray(cols[None], jnp.int32), serve=jnp.ones((1,), bool),
                     full=jnp.asarray(False))
    canvas, state = sched.update(ctx, jnp.asarray([canvas]), state, out, None)
    return np.asarray(canvas)[0].tolist(), state


def test_rules_on_hand_made_logits():
    from asynclane_jax.decoding.schedule import Context

    M = 9
    ctx = Context(batch=1, prompt_len=6, gen_length=6, shift=0, mask_id=M, eos_id=8,
                  stop_ids=(8,), pad_len=jnp.zeros((1,), jnp.int32))
    sched = LLaDA2Schedule(gen_length=6, block_length=4, steps=2, threshold=0.9)
    state = sched.init(ctx)
    assert int(state.block[0]) == 1  # the block holding the first generated position
    canvas = [1, 2, 3, 4, 5, 6] + [M] * 6
    # One masked position above the threshold, fewer than the step's count (2): the
    # two most confident commit; the prompt columns 4 and 5 are never written.
    canvas, state = _hand(sched, canvas, state, {4: (7, 0.99), 6: (3, 0.95), 7: (4, 0.5)})
    assert canvas[:8] == [1, 2, 3, 4, 5, 6, 3, 4] and int(state.block[0]) == 2
    # Block 2 (columns 8-11): two above the threshold, the step's count: only they.
    canvas, state = _hand(sched, canvas, state, {8: (1, 0.95), 9: (2, 0.8),
                                                 10: (3, 0.97), 11: (4, 0.85)})
    assert canvas[8:] == [1, M, 3, M] and not bool(sched.done(ctx, None, state)[0])
    # Step 2 of 2: nothing above, the top 2 (all that is left) commit; the row is done.
    canvas, state = _hand(sched, canvas, state, {9: (2, 0.6), 11: (4, 0.7)})
    assert canvas[8:] == [1, 2, 3, 4] and bool(sched.done(ctx, None, state)[0])

    # LLaDA2.1: a decoded generated position whose confident prediction differs is
    # replaced, a prompt position never; after the last mask, calls go on while they
    # edit, at most max_post_steps.
    sched = LLaDA2Schedule(gen_length=6, block_length=4, steps=2, threshold=0.9,
                           editing_threshold=0.8, max_post_steps=2)
    state = sched.init(ctx)
    canvas = [1, 2, 3, 4, 5, 6] + [M] * 6
    canvas, state = _hand(sched, canvas, state, {6: (3, 0.95), 7: (4, 0.95)})
    assert canvas[4:8] == [5, 6, 3, 4] and int(state.block[0]) == 1  # a post call next
    canvas, state = _hand(sched, canvas, state, {4: (7, 0.99), 6: (5, 0.9), 7: (6, 0.7)})
    assert canvas[4:8] == [5, 6, 5, 4] and int(state.block[0]) == 1  # edited: go on
    canvas, state = _hand(sched, canvas, state, {6: (6, 0.99)})
    assert canvas[4:8] == [5, 6, 6, 4] and int(state.block[0]) == 2  # the cap: 2 calls
    # A post call that edits nothing ends the block at once.
    canvas, state = _hand(sched, canvas, state, {j: (j - 7, 0.99) for j in range(8, 12)})
    canvas, state = _hand(sched, canvas, state, {})
    assert canvas[8:] == [1, 2, 3, 4] and bool(sched.done(ctx, None, state)[0])


@pytest.mark.slow
def test_the_shipped_llada2_model_decodes_as_its_card_says():
    """tiny-llada2-v4b, the LLaDA2-style testbed model, under its own sampler at gen
    length 512: the first 8 held-out problems of task set v4 come out right or wrong
    (and with as many exact lines) as its recorded 500-problem evaluation says, no mask
    is left, and each row makes one full forward, the rest cached calls."""
    import json
    import pathlib

    import asynclane_jax as aj
    from asynclane_jax.testbed import evaluate as ev
    from asynclane_jax.testbed import tasks

    model, _, cfg = aj.load("tiny-llada2-v4b")
    assert cfg.family == "llada2" and cfg.block_causal and cfg.n_experts == 8
    record = json.loads((pathlib.Path(__file__).parents[2] / "experiments" / "results" /
                         "testbed" / "testbed_tiny-llada2-v4b_eval_llada2_512.json").read_text())
    problems = tasks.heldout(8, "v4")
    res = generate(model, ev.prompts_for(problems), sampler="llada2", gen_length=512)
    assert not np.any(res.tokens == cfg.mask_token_id)
    np.testing.assert_array_equal(res.stats.row_nfe_full, 1)
    got = [[bool(tasks.check(p, row)), *tasks.line_accuracy(p, row)]
           for p, row in zip(problems, res.tokens)]
    assert got == [list(r) for r in record["per_problem"][:8]]
    assert any(r[0] for r in got)
