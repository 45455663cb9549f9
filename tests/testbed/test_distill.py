"""D2F distillation: a few steps train only the projection kernels of a block-causal
student, and such a student written as a PEFT LoRA adapter over its teacher's Hugging
Face snapshot converts back (`convert --lora`) to the same weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from hf_reference import llada_hf_config, write_checkpoint

import asynclane_jax
from asynclane_jax.testbed.distill import DistillConfig, Distiller, trainable
from checkpoints_convert.convert import convert
from checkpoints_convert.export import hf_tensors, write_lora_adapter
from checkpoints_convert.names import ConvertError


@pytest.fixture(scope="module")
def distilled():
    d = Distiller(DistillConfig(steps=3, minutes=None, regions=((64, 4, 1.0),)))
    d.fit(progress_bar=False)
    return d


def _flat(model):
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def test_distillation_trains_only_projection_kernels(distilled):
    assert distilled.step == 3 and all(np.isfinite(distilled.log["loss"]))
    assert all(0 <= kl for kl in distilled.log["kl"])
    student = distilled.student()
    assert student.cfg.block_causal
    teacher, _, _ = asynclane_jax.load("tiny-llada")
    leaves = lambda m: jax.tree_util.tree_flatten_with_path(nnx.state(m, nnx.Param))[0]
    changed = [path for (path, a), (_, b) in zip(leaves(student), leaves(teacher))
               if not np.array_equal(np.asarray(a), np.asarray(b))]
    assert changed and all(trainable(path) for path in changed)
    names = [jax.tree_util.keystr(p) for p in changed]
    assert not any(w in n for n in names for w in ("embed", "norm", "bias", "lm_head"))


def test_student_as_lora_adapter_converts_back(distilled, tmp_path):
    student = distilled.student()
    teacher, _, cfg = asynclane_jax.load("tiny-llada")
    hf = llada_hf_config(
        d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, mlp_hidden_size=cfg.mlp_hidden,
        embedding_size=cfg.vocab_size, vocab_size=cfg.vocab_size,
        include_qkv_bias=cfg.qkv_bias, mask_token_id=cfg.mask_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
        max_sequence_length=cfg.max_seq_len, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps)
    base = {k: torch.from_numpy(np.array(v)) for k, v in hf_tensors(teacher).items()}
    write_checkpoint(tmp_path / "base", hf, base)
    adapter = write_lora_adapter(student, teacher, tmp_path / "lora")
    assert adapter["r"] == min(cfg.d_model, cfg.mlp_hidden)
    convert(str(tmp_path / "base"), tmp_path / "dst", lora=str(tmp_path / "lora"),
            progress=False, block_causal=True)
    back, _, back_cfg = asynclane_jax.load(tmp_path / "dst")
    assert back_cfg.block_causal
    got, want = _flat(back), _flat(student)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=2e-6, rtol=1e-5, err_msg=k)
    # The teacher itself round-trips without an adapter too (the name table inverted).
    plain, _, _ = asynclane_jax.load(
        convert(str(tmp_path / "base"), tmp_path / "plain", progress=False).dst)
    for k, v in _flat(teacher).items():
        np.testing.assert_array_equal(_flat(plain)[k], v)


def test_lora_cannot_carry_a_changed_norm(tmp_path):
    teacher, _, _ = asynclane_jax.load("tiny-llada")
    tuned = nnx.clone(teacher)
    tuned.final_norm.scale[...] = tuned.final_norm.scale[...] * 1.5
    with pytest.raises(ConvertError, match="cannot carry"):
        write_lora_adapter(tuned, teacher, tmp_path / "lora")
    with pytest.raises(ConvertError, match="nothing to write"):
        write_lora_adapter(teacher, teacher, tmp_path / "lora2")


def test_a_long_answer_teacher_distils_on_its_own_problems():
    """A teacher trained on a long-answer task set hands the student its task set,
    family weights and length buckets; batches then take the shapes of those buckets
    and the stream draws that task set's families."""
    from asynclane_jax.testbed import tasks

    dc = DistillConfig.for_teacher("tiny-llada-v4b", steps=1, minutes=None)
    assert dc.task_set == "v4" and dc.family_weights == (1.0, 1.0, 3.0, 3.0)
    assert [b[1] for b in dc.buckets] == [64, 128, 256, 512]
    assert dc.to_dict()["buckets"][-1] == [28, 512, 4, 0.5]
    # The student's folder records its distillation config: its task set reads from it.
    assert tasks.recorded_task_set({"distill": dc.to_dict()}) == "v4"
    assert tasks.recorded_task_set({"distill": DistillConfig().to_dict()}) == "v1"
    # A first-task-set teacher keeps the default regions and no buckets.
    assert DistillConfig.for_teacher("tiny-llada").buckets is None
    d = Distiller(dc)
    shapes = {(b[2], b[0] + b[1]) for b in dc.buckets}  # (rows, prompt + region)
    rng = np.random.default_rng(0)
    drawn = {d.buckets.batch(rng)["tokens"].shape for _ in range(8)}
    assert drawn <= shapes and len(drawn) >= 2
    families = {next(d.stream).family for _ in range(60)}
    assert families == set(tasks.families_of("v4"))
