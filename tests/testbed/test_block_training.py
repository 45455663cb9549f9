"""The trainer's block-diffusion objective (the LLaDA2-style model, tiny-llada2-v4): the
doubled canvas's two-order block ids give each noisy block exactly its own block and
the clean blocks before it, so its logits equal a block-causal forward over a canvas
whose earlier blocks are finished, which is what the `llada2` sampler decodes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asynclane_jax.models.config import LLaDA2Config
from asynclane_jax.testbed import card, train

B = 8  # block length of the tiny runs


def _tiny(**changes):
    moe = dict(train.LLADA2_V4_MOE, n_experts=4, n_expert_groups=2, n_topk_groups=1,
               moe_hidden=16, rotary_dim=4)
    return train.llada2_v4_config(
        d_model=32, n_layers=2, head_dim=8, mlp_hidden=64, moe=moe, block_length=B,
        task_set="v1", buckets=None, regions=((64, 2, 1.0),), prompt_length=28, lr=3e-3,
        warmup_steps=1, family_weights=None,
        steps=100, minutes=None, eval_every_s=0, **changes)


def test_the_llada2_config_is_a_block_causal_moe_and_refuses_mixtures():
    tc = train.llada2_v4_config()
    assert (tc.family, tc.objective, tc.eval_sampler) == ("llada2", "block", "llada2")
    cfg = tc.model_config()
    assert isinstance(cfg, LLaDA2Config) and cfg.block_causal and not cfg.logit_shift
    assert cfg.n_experts == 8 and cfg.first_dense_layers == 1 and cfg.rotary_dim == 8
    teacher = train.v4_config()
    assert (tc.buckets, tc.task_set, tc.d_model, tc.n_layers) == (
        teacher.buckets, teacher.task_set, teacher.d_model, teacher.n_layers)
    with pytest.raises(ValueError, match="block-diffusion objective"):
        train.TrainConfig(objective="block")  # a dense llada model monitored with vanilla
    with pytest.raises(ValueError, match="block-diffusion objective"):
        dataclasses.replace(tc, eval_sampler="fast-dllm")
    with pytest.raises(ValueError, match="q/k/v biases"):
        dataclasses.replace(tc, qkv_bias=True)


def test_the_doubled_canvas_ids_see_what_the_sampler_sees():
    blocks = jnp.asarray([[-1, 0, 0, 1, 1, 2]])  # one pad column, then blocks 0..2
    ids = np.asarray(train.block_diffusion_ids(blocks))[0]  # [12, 2]
    n = blocks.shape[1]
    seen = np.all(ids[None, :, :] <= ids[:, None, :], axis=-1)  # [query, key]
    b = np.asarray(blocks)[0]
    for q in range(2 * n):
        for k in range(2 * n):
            qb, kb = b[q % n], b[k % n]
            if q < n:  # a noisy query: its own noisy block, the clean blocks before it
                want = (kb == qb) if k < n else (kb < qb)
            else:  # a clean query: the clean blocks up to its own, nothing noisy
                want = k >= n and kb <= qb
            assert seen[q, k] == want, (q, k)


def test_a_noisy_block_reads_as_the_sampler_reads_it():
    """The doubled forward's noisy block i = a block-causal forward of the canvas whose
    blocks before i are clean and block i is the noisy one."""
    tc = _tiny()
    trainer = train.Trainer(tc)
    model = nnx.merge(trainer.graphdef, trainer.params)
    batch = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}
    tokens, key_mask = batch["tokens"], batch["key_mask"]
    b, n = tokens.shape
    cols = jnp.arange(n)[None, :]
    blocks = (cols - batch["start"][:, None]) // B
    masked = batch["response"] & (jax.random.uniform(jax.random.key(3), (b, n)) < 0.5)
    noisy = jnp.where(masked, trainer.cfg.mask_token_id, tokens)
    pos = jnp.broadcast_to(cols, (b, n))
    doubled = jax.jit(lambda: model(jnp.concatenate([noisy, tokens], 1),
                    positions=jnp.concatenate([pos, pos], 1),
                    key_mask=jnp.concatenate([key_mask, key_mask], 1),
                    block_ids=train.block_diffusion_ids(blocks)))()[:, :n]
    plain_fwd = jax.jit(lambda canvas: model(canvas, key_mask=key_mask, block_ids=blocks))
    checked = wrong_checked = 0
    for i in range(int(blocks.max()) + 1):
        plain = np.asarray(plain_fwd(jnp.where(blocks < i, tokens, noisy)))
        sel = np.asarray((blocks == i) & key_mask)
        np.testing.assert_allclose(np.asarray(doubled)[sel], plain[sel], atol=2e-5)
        checked += sel.sum()
        # The clean prefix matters: where the prefix had masks, a noisy one reads
        # differently.
        differs = sel & np.asarray(jnp.any(masked & (blocks < i), axis=1))[:, None]
        if differs.any():
            wrong = np.asarray(plain_fwd(noisy))
            assert not np.allclose(wrong[differs], plain[differs], atol=1e-4)
            wrong_checked += 1
    assert wrong_checked > 0
    assert checked > 0.9 * int(key_mask.sum())


@pytest.mark.slow
def test_block_steps_lower_the_loss_and_the_monitor_decodes_with_llada2():
    trainer = train.Trainer(_tiny())
    probe = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}
    key = jax.random.key(0)

    def probe_loss():
        return float(train.block_diffusion_loss(trainer.current_model(), probe, key,
                                                block_length=B)[0])

    before = probe_loss()
    for _ in range(12):
        rec = trainer.train_step()
    assert np.isfinite(rec["loss"]) and 0 < rec["mask_frac"] < 1
    assert probe_loss() < 0.8 * before
    res = train.monitor(trainer.current_model(), train.tasks.heldout(2, "v1"),
                        gen_length=16, prompt_length=28, sampler="llada2")
    assert 0.0 <= res["acc"] <= 1.0 and "acc_math" in res


def test_the_card_of_a_llada2_model_says_what_it_is():
    tc = train.llada2_v4_config(minutes=75.0, family_weights=(1.0, 1.0, 3.0, 3.0))
    config = {"model": dataclasses.asdict(tc.model_config())}
    log = {"config": tc.to_dict(), "elapsed_s": 4500.0, "params": 705192, "step": 100,
           "evals": []}
    ev = {"sampler": "llada2", "options": {}, "gen_length": 512, "n": 8, "accuracy": 1.0,
          "line_accuracy": 1.0, "nfe_per_token": 0.1, "tps": 100.0}
    text = card.render("tiny-llada2-v4", config, log, [ev])
    assert "block-diffusion mixture-of-experts language model" in text
    assert "mixtures of 8 experts, top-2 of the best 2 of 4 groups, 1 shared" in text
    assert "Block diffusion (LLaDA2's objective" in text
    assert "--objective block" in text and "--model" not in text.split("Command:")[1]
    assert "llada2: LLaDA2.0's block diffusion" in text


def test_a_llada2_model_warm_starts_a_block_run_with_its_bucket_weights():
    """A block-diffusion run may start from a shipped llada2 model (its architecture,
    mixture of experts included, and its weights); --bucket-weights reweights the length
    buckets' steps; the card's command names both."""
    arch = train.source_architecture("tiny-llada2-v4")
    assert arch["family"] == "llada2" and arch["moe"] == train.LLADA2_V4_MOE
    assert "moe" not in train.source_architecture("tiny-llada-v4b")
    arch.pop("family")
    tc = train.llada2_v4_config(name="tiny-llada2-v4b", init_from="tiny-llada2-v4",
                                minutes=70.0, lr=1e-3, **arch)
    tc = tc.with_bucket_probs(["2", "0.4", "0.6", "1"])
    assert [b[3] for b in tc.buckets] == [0.5, 0.1, 0.15, 0.25]
    assert [b[:3] for b in tc.buckets] == [b[:3] for b in train.V3_BUCKETS]
    fresh = nnx.split(train.DiffusionLM(tc.model_config(), rngs=nnx.Rngs(0)))[1]
    warm = train.warm_start_params(fresh, "tiny-llada2-v4")
    from asynclane_jax import checkpoint

    source = nnx.split(checkpoint.load_model(checkpoint.resolve("tiny-llada2-v4")))[1]
    for a, b in zip(jax.tree.leaves(warm), jax.tree.leaves(source)):
        np.testing.assert_array_equal(a, b)
    assert card.train_command(tc.to_dict()) == (
        "python experiments/train_testbed.py --objective block --minutes 70 --name "
        "tiny-llada2-v4b --lr 0.001 --init-from tiny-llada2-v4 --t-max-start 0.25 "
        "--t-ramp 0.2 --task-set v4 --bucket-weights 0.5,0.1,0.15,0.25")
    assert "--bucket-weights" not in card.train_command(train.llada2_v4_config().to_dict())
    for bad, match in ((["1", "2"], "2 weights for 4"), (["0"] * 4, "at least one"),
                       (["1", "-1", "1", "1"], "non-negative"), (["nan"] * 4, "finite")):
        with pytest.raises(ValueError, match=match):
            tc.with_bucket_probs(bad)
    with pytest.raises(ValueError, match="no length buckets"):
        _tiny().with_bucket_probs([1])
