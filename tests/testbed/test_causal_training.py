"""The trainer's causal objective (the autoregressive baseline, tiny-ar-v4): its config
is causal and logit-shifted, its loss is a next-token loss under causal attention over
the answer and its first end-of-text, a few steps lower it, and the monitor decodes the
model with the `ar` sampler."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asynclane_jax.testbed import card, train


def _tiny(**changes):
    return train.llada_config(
        d_model=32, n_layers=2, head_dim=8, mlp_hidden=64, n_kv_heads=2,
        regions=((64, 8, 1.0),), lr=3e-3, warmup_steps=1, steps=100, minutes=None,
        eval_every_s=0, objective="causal", eval_sampler="ar", **changes)


def test_the_ar_config_is_the_v4_teachers_but_causal():
    tc = train.ar_v4_config()
    teacher = train.v4_config()
    assert tc.objective == "causal" and tc.eval_sampler == "ar" and tc.name == "tiny-ar-v4"
    assert tc.t_ramp == 0  # nothing is masked: no mask-ratio curriculum
    differ = {"name", "objective", "eval_sampler", "t_ramp"}
    same = {f.name for f in dataclasses.fields(tc)} - differ
    assert all(getattr(tc, k) == getattr(teacher, k) for k in same)
    cfg = tc.model_config()
    assert cfg.causal and cfg.logit_shift and not cfg.block_causal
    assert cfg.replace(causal=False, logit_shift=False) == teacher.model_config()
    assert card._objective(tc.to_dict()).startswith("Next-token prediction")
    assert card._objective(teacher.to_dict()).startswith("Masked diffusion")
    with pytest.raises(ValueError, match="objective"):
        train.TrainConfig(objective="autoregressive")
    with pytest.raises(ValueError, match="ar sampler"):
        train.TrainConfig(objective="causal")  # monitored with vanilla: refused


def test_the_causal_loss_is_next_token_and_causal():
    """Changing a token changes no earlier position's loss term, and the tail after
    the first end-of-text is not scored."""
    trainer = train.Trainer(_tiny())
    model = nnx.merge(trainer.graphdef, trainer.params)
    batch = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}
    loss, aux = train.causal_loss(model, batch)
    assert np.isfinite(float(loss)) and 0 < float(aux["mask_frac"]) < 1
    # The scored share is the answers and one end-of-text each.
    response = np.asarray(batch["response"])
    eos = trainer.cfg.eos_token_id
    toks = np.asarray(batch["tokens"])
    P = int(np.argmax(response[0]))
    lens = [int(np.argmax(row[P:] == eos)) + 1 for row in toks]
    assert float(aux["mask_frac"]) == pytest.approx(sum(lens) / response.sum())
    # Causality: the logits before column c do not see the token at c.
    cols = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
    c = P + 3
    changed = batch["tokens"].at[:, c].set((batch["tokens"][:, c] + 1) % trainer.cfg.vocab_size)
    a = model(batch["tokens"], key_mask=batch["key_mask"], block_ids=cols)
    b = model(changed, key_mask=batch["key_mask"], block_ids=cols)
    # (A left-padding column whose keys are all masked sees none; its output is never
    # read, nor are its K/V.)
    seen = np.asarray(batch["key_mask"])[:, :c]
    np.testing.assert_allclose(np.asarray(a[:, :c])[seen], np.asarray(b[:, :c])[seen],
                               atol=1e-5)
    assert not np.allclose(np.asarray(a[:, c]), np.asarray(b[:, c]))


@pytest.mark.slow
def test_a_few_causal_steps_lower_the_loss_and_the_monitor_decodes_with_ar():
    trainer = train.Trainer(_tiny())
    probe = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}

    def probe_loss():
        return float(train.causal_loss(trainer.current_model(), probe)[0])

    before = probe_loss()
    for _ in range(12):
        rec = trainer.train_step()
    assert np.isfinite(rec["loss"])
    assert probe_loss() < 0.8 * before
    trainer.tc = dataclasses.replace(trainer.tc, eval_n=2, eval_gen_length=16)
    res = trainer.evaluate()
    assert 0.0 <= res["acc"] <= 1.0


def test_the_card_of_a_causal_model_says_what_it_is():
    tc = train.ar_v4_config(minutes=85.0, qkv_bias=True)
    config = {"model": dataclasses.asdict(tc.model_config())}
    log = {"config": tc.to_dict(), "elapsed_s": 5100.0, "params": 420928, "step": 100,
           "evals": []}
    ev = {"sampler": "ar", "options": {}, "gen_length": 512, "n": 8, "accuracy": 1.0,
          "line_accuracy": 1.0, "nfe_per_token": 1.0, "tps": 100.0}
    text = card.render("tiny-ar-v4", config, log, [ev])
    assert "A tiny autoregressive language model (multi-head attention, q/k/v biases, causal" \
        in text and "masked-diffusion" not in text.split("## Task")[0]
    assert "Next-token prediction" in text and "--objective causal" in text
    assert "ar: greedy, left to right" in text and "Vanilla: steps" not in text
