"""`asynclane-jax convert`: tiny checkpoints in the real HF layouts, converted by the CLI,
loaded, and compared with the transformers reference; every kind of bad input."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import subprocess
import sys

import hf_reference as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from hostile import leftovers

from asynclane_jax import load
from asynclane_jax.cli import main
from asynclane_jax.models import dream_7b_instruct, from_hf_config, llada_8b_instruct
from checkpoints_convert import convert as conv
from checkpoints_convert.names import ConvertError, expected_sources, plan

jax.config.update("jax_default_matmul_precision", "highest")

TOKENS = H.TOKENS


@nnx.jit
def forward(model, tokens):
    return model(tokens)


run_cli = H.convert_cli


def assert_matches_reference(dst, hf, tensors, tol=1e-4):
    model, tokenizer, cfg = load(dst, dtype="float32")
    assert tokenizer is not None and cfg.family == str(hf["model_type"]).lower()
    ours = np.asarray(forward(model, jnp.asarray(TOKENS)))
    want = H.reference_logits(hf, tensors, TOKENS)
    assert np.max(np.abs(ours - want)) <= tol
    return model


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("family, layout, dtype", [
    ("llada", "single", torch.float32),
    ("dream", "sharded", torch.bfloat16),  # bf16, as the real checkpoints are stored
    ("llada", "bin", torch.bfloat16),
    ("dream", "bin_sharded", torch.float32),
])
def test_convert_layout_then_load_matches_reference(tmp_path, capsys, family, layout, dtype):
    hf = H.llada_hf_config() if family == "llada" else H.dream_hf_config()
    tensors = H.random_tensors(hf, seed=1, dtype=dtype)
    src = H.write_checkpoint(tmp_path / "src", hf, tensors, layout=layout)
    rc, out, err = run_cli(capsys, src, tmp_path / "dst", "--dtype", "float32")
    assert rc == 0, err
    assert out.startswith(f"converted {family}: {len(tensors)} tensors")
    assert_matches_reference(tmp_path / "dst", hf, tensors)
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert saved["hf_config"] == hf  # kept verbatim, auto_map included
    assert saved["model"]["param_dtype"] == "float32"
    assert leftovers(tmp_path) == []


def test_default_dtype_follows_source_and_bf16_output(tmp_path, capsys):
    hf = H.dream_hf_config()
    tensors = H.random_tensors(hf, seed=2, dtype=torch.bfloat16)
    src = H.write_checkpoint(tmp_path / "src", hf, tensors, layout="single")
    rc, _, err = run_cli(capsys, src, tmp_path / "dst")
    assert rc == 0, err
    model, _, cfg = load(tmp_path / "dst")
    assert cfg.param_dtype == "bfloat16"
    assert model.layers[0].attn.q_proj.kernel[...].dtype == jnp.bfloat16
    # bf16 -> bf16 is exact: the stored kernel is the transposed source weight.
    want = tensors["model.layers.0.self_attn.q_proj.weight"].float().numpy().T
    np.testing.assert_array_equal(np.asarray(model.layers[0].attn.q_proj.kernel[...],
                                             np.float32), want)


def test_dream_tokenizer_built_without_remote_code(tmp_path, capsys):
    hf = H.dream_hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf), tokenizer="bpe")
    assert not (src / "tokenizer.json").exists()
    rc, _, err = run_cli(capsys, src, tmp_path / "dst")
    assert rc == 0, err
    _, tokenizer, _ = load(tmp_path / "dst")
    assert tokenizer.encode("abd c<|mask|>") == [7, 6, 10]
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 8


def _add_end_of_turn(src: pathlib.Path, family: str, *, template: bool = True) -> int:
    """Declares the family's end-of-turn token in a snapshot's tokenizer files, as the
    instruct checkpoints do (LLaDA: tokenizer.json added_tokens; Dream: the slow
    tokenizer's added_tokens_decoder), with a chat template ending turns with it."""
    tok_cfg = json.loads((src / "tokenizer_config.json").read_text())
    if family == "llada":
        content, token_id = "<|eot_id|>", 60
        tok = json.loads((src / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab[content] = vocab.pop(f"w{token_id}")
        tok["added_tokens"].append({"id": token_id, "content": content, "single_word": False,
                                    "lstrip": False, "rstrip": False, "normalized": False,
                                    "special": True})
        (src / "tokenizer.json").write_text(json.dumps(tok))
    else:
        content = "<|im_end|>"
        token_id = int(next(i for i, t in tok_cfg["added_tokens_decoder"].items()
                            if t["content"] == content))
    if template:
        tok_cfg["chat_template"] = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                                    + content + "{% endfor %}")
    (src / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return token_id


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_end_of_turn_taken_from_tokenizer(tmp_path, capsys, family):
    hf = H.llada_hf_config() if family == "llada" else H.dream_hf_config()
    assert "eot_token_id" not in hf  # as in the published config.json files
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf),
                             tokenizer=True if family == "llada" else "bpe")
    eot = _add_end_of_turn(src, family)
    rc, _, err = run_cli(capsys, src, tmp_path / "dst")
    assert rc == 0, err
    _, tokenizer, cfg = load(tmp_path / "dst")
    assert cfg.eot_token_id == eot and cfg.stop_token_ids == (hf["eos_token_id"], eot)
    content = "<|eot_id|>" if family == "llada" else "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids(content) == eot
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert saved["model"]["eot_token_id"] == eot and saved["hf_config"] == hf


def test_no_end_of_turn_without_chat_template(tmp_path, capsys):
    # A base model's tokenizer may reserve the token; no template uses it: EOS only.
    hf = H.llada_hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf))
    _add_end_of_turn(src, "llada", template=False)
    assert run_cli(capsys, src, tmp_path / "dst")[0] == 0
    assert load(tmp_path / "dst")[2].stop_token_ids == (62,)


def test_progress_bar_and_summary(tmp_path, capsys):
    hf = H.llada_hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf), layout="single")
    assert main(["convert", str(src), str(tmp_path / "dst")]) == 0
    out = capsys.readouterr()
    assert "convert" in out.err and "B/" in out.err  # tqdm, bytes done / total, on stderr
    assert len(out.out.strip().splitlines()) == 1 and "parameters" in out.out


def test_lora_merge_and_verify(tmp_path, capsys):
    hf = H.llada_hf_config()
    base = H.random_tensors(hf, seed=3)
    src = H.write_checkpoint(tmp_path / "src", hf, base, layout="sharded")
    # PEFT's suffix matching makes "ff_out" hit both the MLP down projection and the head.
    merged = H.write_lora_adapter(tmp_path / "lora", base, [
        "q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "ff_out"])
    rc, out, err = run_cli(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora",
                           "--dtype", "float32", "--verify")
    assert rc == 0, err
    assert "15 LoRA-merged" in out
    line = next(x for x in out.splitlines() if x.startswith("verify:"))
    assert "LlamaForCausalLM" in line and "top-1 agreement 21/21" in line
    assert float(line.split("max |logit diff| ")[1].split(",")[0]) < 1e-4
    # The merged weights are larger than the base's (logits up to ~10): float32 rounding
    # of the two implementations reaches ~1.1e-4 here (2e-5 relative).
    model = assert_matches_reference(tmp_path / "dst", hf, merged, tol=2e-4)
    # ... and really differs from the base model.
    assert np.max(np.abs(np.asarray(forward(model, jnp.asarray(TOKENS)))
                         - H.reference_logits(hf, base, TOKENS))) > 1e-2
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert saved["converted_from"]["lora"]["r"] == 4


def test_verify_dream_bf16(tmp_path, capsys):
    hf = H.dream_hf_config()
    tensors = H.random_tensors(hf, seed=4, dtype=torch.bfloat16)
    src = H.write_checkpoint(tmp_path / "src", hf, tensors, layout="single")
    rc, out, err = run_cli(capsys, src, tmp_path / "dst", "--verify")
    assert rc == 0, err
    assert "Qwen2ForCausalLM" in out and "(100.0%)" in out


def test_python_dash_m_entry_point(tmp_path):
    hf = H.llada_hf_config(weight_tying=True)
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf), layout="single")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    ok = subprocess.run([sys.executable, "-m", "checkpoints_convert", str(src),
                         str(tmp_path / "dst")], capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "converted llada" in ok.stdout
    again = subprocess.run([sys.executable, "-m", "checkpoints_convert", str(src),
                            str(tmp_path / "dst")], capture_output=True, text=True, env=env)
    assert again.returncode == 2 and "already exists" in again.stderr
    assert "Traceback" not in again.stderr and len(again.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- name tables

@pytest.mark.parametrize("cfg, hf, n", [(llada_8b_instruct(), H.llada_8b_hf_config(), 291),
                                        (dream_7b_instruct(), H.dream_7b_hf_config(), 339)])
def test_tables_cover_the_real_checkpoints(cfg, hf, n):
    """From abstract shapes only (no weights): the 8B / 7B tensor lists, fully covered."""
    derived = expected_sources(cfg)
    assert len(derived) == n
    assert derived == H.tensor_shapes(hf)  # the hand-written listing of the real names
    assignments = plan(from_hf_config(hf), derived)
    assert len(assignments) == n
    assert len({a.target for a in assignments.values()}) == n


def test_llada_block_names():
    names = {k for k in expected_sources(llada_8b_instruct()) if ".blocks.7." in k}
    assert names == {f"model.transformer.blocks.7.{m}.weight" for m in (
        "attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj",
        "up_proj", "ff_out")}


# --------------------------------------------------------------------------- atomicity

def test_existing_output_refused_then_forced(tmp_path, capsys):
    hf = H.llada_hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf, seed=5))
    dst = tmp_path / "dst"
    assert run_cli(capsys, src, dst)[0] == 0
    before = (dst / "config.json").read_text()
    rc, _, err = run_cli(capsys, src, dst)
    assert rc == 2 and "already exists" in err and "--force" in err
    hf2 = H.dream_hf_config()
    src2 = H.write_checkpoint(tmp_path / "src2", hf2, H.random_tensors(hf2, seed=6))
    assert run_cli(capsys, src2, dst, "--force")[0] == 0
    assert (dst / "config.json").read_text() != before
    assert leftovers(tmp_path) == []
    rc, _, err = run_cli(capsys, src, src, "--force")
    assert rc == 2 and "overwrite the source" in err


@pytest.mark.parametrize("stage", ["tensors", "save"])
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, stage):
    hf = H.llada_hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf), layout="sharded")
    seen = []

    def on_tensor(name):
        seen.append(name)
        if stage == "tensors" and len(seen) == 3:
            raise KeyboardInterrupt

    if stage == "save":
        def broken(*args, **kwargs):
            raise OSError("disk full")
        monkeypatch.setattr(conv.checkpoint, "save_params", broken)
    with pytest.raises((KeyboardInterrupt, OSError)):
        conv.convert(str(src), tmp_path / "dst", progress=False, on_tensor=on_tensor)
    assert not (tmp_path / "dst").exists()
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------- bad input

def _snapshot(tmp_path, family="llada", layout="single", **hf_overrides):
    hf = (H.llada_hf_config if family == "llada" else H.dream_hf_config)(**hf_overrides)
    tensors = H.random_tensors(hf, seed=9)
    return H.write_checkpoint(tmp_path / "src", hf, tensors, layout=layout), hf, tensors


def _bad(capsys, src, dst, *extra):
    rc, out, err = run_cli(capsys, src, dst, *extra)
    assert rc == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not pathlib.Path(dst).exists()
    return err


def test_missing_folder(tmp_path, capsys):
    assert "does not exist" in _bad(capsys, tmp_path / "nope", tmp_path / "dst")


def test_no_config(tmp_path, capsys):
    src, _, _ = _snapshot(tmp_path)
    (src / "config.json").unlink()
    assert "no config.json" in _bad(capsys, src, tmp_path / "dst")


def test_no_weights(tmp_path, capsys):
    src, _, _ = _snapshot(tmp_path)
    (src / "model.safetensors").unlink()
    assert "no weights" in _bad(capsys, src, tmp_path / "dst")


def test_unsupported_model_type(tmp_path, capsys):
    src, hf, _ = _snapshot(tmp_path)
    hf.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (src / "config.json").write_text(json.dumps(hf))
    assert "unsupported model_type 'gpt2'" in _bad(capsys, src, tmp_path / "dst")


def test_truncated_shard(tmp_path, capsys):
    src, _, _ = _snapshot(tmp_path, layout="sharded")
    shard = src / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    err = _bad(capsys, src, tmp_path / "dst")
    assert "model-00002-of-00002.safetensors is truncated" in err


def test_corrupt_shard_header(tmp_path, capsys):
    src, _, _ = _snapshot(tmp_path)
    data = bytearray((src / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    data[8:8 + n] = b"{" * n
    (src / "model.safetensors").write_bytes(bytes(data))
    assert "corrupt" in _bad(capsys, src, tmp_path / "dst")


def test_corrupt_bin(tmp_path, capsys):
    src, _, _ = _snapshot(tmp_path, layout="bin")
    (src / "pytorch_model.bin").write_bytes(b"not a zip" * 100)
    assert "cannot read shard pytorch_model.bin" in _bad(capsys, src, tmp_path / "dst")


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_bin_with_arbitrary_objects_is_refused(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path, layout="bin")
    torch.save({**tensors, "evil": Payload()}, src / "pytorch_model.bin")
    assert "cannot read shard" in _bad(capsys, src, tmp_path / "dst")


def test_index_names_missing_shard(tmp_path, capsys):
    src, _, _ = _snapshot(tmp_path, layout="sharded")
    (src / "model-00001-of-00002.safetensors").unlink()
    err = _bad(capsys, src, tmp_path / "dst")
    assert "missing" in err and "model-00001-of-00002.safetensors" in err


def _rewrite(src, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(src / "model.safetensors"))


def test_shape_mismatch(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    tensors["model.transformer.blocks.1.up_proj.weight"] = torch.zeros(63, 32)
    _rewrite(src, tensors)
    err = _bad(capsys, src, tmp_path / "dst")
    assert "model.transformer.blocks.1.up_proj.weight has shape [63, 32], the config needs " \
           "[64, 32]" in err


def test_unknown_tensor(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    tensors["model.transformer.blocks.0.att_proj.weight"] = torch.zeros(96, 32)
    _rewrite(src, tensors)
    assert "1 unknown tensors (model.transformer.blocks.0.att_proj.weight)" in _bad(
        capsys, src, tmp_path / "dst")


def test_tensor_without_parameter(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    tensors["model.transformer.blocks.2.q_proj.weight"] = torch.zeros(32, 32)  # 2 layers
    _rewrite(src, tensors)
    assert "no parameter for" in _bad(capsys, src, tmp_path / "dst")


def test_duplicated_tensor_across_shards(tmp_path, capsys):
    from safetensors.torch import save_file

    src, _, tensors = _snapshot(tmp_path, family="dream", layout="sharded")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    dup = "model.norm.weight"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][dup])
    part = {n: tensors[n] for n, f in index["weight_map"].items() if f == other}
    save_file({**part, dup: tensors[dup]}, str(src / other))
    (src / "model.safetensors.index.json").unlink()  # no index to arbitrate
    assert "duplicated tensors (model.norm.weight" in _bad(capsys, src, tmp_path / "dst")


def test_all_problems_reported_together(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    del tensors["model.transformer.ln_f.weight"]
    tensors["model.transformer.blocks.0.q_proj.weight"] = torch.zeros(32, 31)
    tensors["lm_head.weight"] = torch.zeros(64, 32)
    _rewrite(src, tensors)
    err = _bad(capsys, src, tmp_path / "dst")
    for part in ("1 unknown tensors (lm_head.weight)", "1 shape mismatches",
                 "1 missing tensors (model.transformer.ln_f.weight)", "nothing was written"):
        assert part in err
    assert leftovers(tmp_path) == []


def test_lora_target_missing_from_base(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    H.write_lora_adapter(tmp_path / "lora", {"model.transformer.blocks.5.q_proj.weight":
                                             torch.zeros(32, 32)}, ["q_proj"])
    err = _bad(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora")
    assert "LoRA pair for model.transformer.blocks.5.q_proj.weight" in err


def test_lora_unsupported_variant(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    H.write_lora_adapter(tmp_path / "lora", tensors, ["q_proj"])
    cfg = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(cfg))
    assert "DoRA" in _bad(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora")


def test_lora_activated_refused(tmp_path, capsys):
    src, _, tensors = _snapshot(tmp_path)
    H.write_lora_adapter(tmp_path / "lora", tensors, ["q_proj"])
    cfg = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    cfg["alora_invocation_tokens"] = [5, 17]
    (tmp_path / "lora" / "adapter_config.json").write_text(json.dumps(cfg))
    err = _bad(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora")
    assert "alora_invocation_tokens=[5, 17]" in err and "activated LoRA" in err


def _lm_head_adapter(folder, base, *, fmt="safetensors", copy=None):
    """A Dream adapter targeting lm_head, with the base weight copy PEFT saves for it."""
    from safetensors.torch import load_file, save_file

    merged = H.write_lora_adapter(folder, base, ["q_proj", "v_proj", "lm_head"])
    adapter = load_file(str(folder / "adapter_model.safetensors"))
    adapter["base_model.model.lm_head.base_layer.weight"] = (
        base["lm_head.weight"] if copy is None else copy)
    (folder / "adapter_model.safetensors").unlink()
    if fmt == "bin":
        torch.save(adapter, folder / "adapter_model.bin")
    else:
        save_file(adapter, str(folder / "adapter_model.safetensors"))
    return merged


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_lora_dream_lm_head_with_base_copy(tmp_path, capsys, monkeypatch, fmt):
    hf = H.dream_hf_config()
    base = H.random_tensors(hf, seed=10)
    src = H.write_checkpoint(tmp_path / "src", hf, base, layout="single")
    merged = _lm_head_adapter(tmp_path / "lora", base, fmt=fmt)
    loads = []
    real_load = conv.reader.torch_load
    monkeypatch.setattr(conv.reader, "torch_load", lambda p: loads.append(p) or real_load(p))
    rc, out, err = run_cli(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora",
                           "--dtype", "float32")
    assert rc == 0, err
    assert "5 LoRA-merged" in out  # 2 layers x (q, v) + lm_head; the copy is not merged
    assert_matches_reference(tmp_path / "dst", hf, merged)
    # The snapshot is safetensors: the only pickle is the adapter, read once for all pairs.
    assert len(loads) == (1 if fmt == "bin" else 0)


def test_lora_base_copy_of_another_base_refused(tmp_path, capsys):
    hf = H.dream_hf_config()
    base = H.random_tensors(hf, seed=11)
    src = H.write_checkpoint(tmp_path / "src", hf, base, layout="single")
    _lm_head_adapter(tmp_path / "lora", base, copy=base["lm_head.weight"] + 0.01)
    err = _bad(capsys, src, tmp_path / "dst", "--lora", tmp_path / "lora")
    assert "copy of lm_head.weight" in err and "another base model" in err
    assert leftovers(tmp_path) == []


def test_hub_id_only_from_local_cache(tmp_path, capsys):
    err = _bad(capsys, "some-org/not-cached-model", tmp_path / "dst")
    assert "not in the local Hugging Face cache" in err and "never downloads" in err
    # A snapshot already in the cache is found without any network access.
    cache = tmp_path / "hub"
    repo = cache / "models--some-org--tiny-llada"
    commit = "0123456789abcdef0123456789abcdef01234567"
    hf = H.llada_hf_config()
    H.write_checkpoint(repo / "snapshots" / commit, hf, H.random_tensors(hf), tokenizer=False)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    result = conv.convert("some-org/tiny-llada", tmp_path / "dst", progress=False,
                          cache_dir=str(cache))
    assert result.n_tensors == 21


def test_converted_family_detection_is_exact(tmp_path, capsys):
    src, hf, _ = _snapshot(tmp_path)
    hf.update(model_type="llada_moe", architectures=["LLaDAMoEModelLM"])
    (src / "config.json").write_text(json.dumps(hf))
    err = _bad(capsys, src, tmp_path / "dst")
    assert "unsupported model_type 'llada_moe'" in err and "missing" not in err


def test_registered_shipped_model(tmp_path, capsys):
    from asynclane_jax import checkpoint

    hf = H.llada_hf_config()
    src = H.write_checkpoint(tmp_path / "src", hf, H.random_tensors(hf))
    assert run_cli(capsys, src, tmp_path / "dst")[0] == 0
    assert {"tiny-llada", "tiny-dream"} <= set(checkpoint.shipped_models())
    assert checkpoint.resolve("tiny-llada") == checkpoint.BUILTIN_MODELS_DIR / "tiny-llada"
    try:
        checkpoint.register_shipped("my-tiny", tmp_path / "dst")
        assert "my-tiny" in checkpoint.shipped_models()
        assert load("my-tiny")[2] == load(tmp_path / "dst")[2]
        with pytest.raises(checkpoint.CheckpointError, match="already"):
            checkpoint.register_shipped("tiny-llada", tmp_path / "dst")
        with pytest.raises(checkpoint.CheckpointError, match="convert it first"):
            checkpoint.register_shipped("other", tmp_path / "src")  # a Hugging Face snapshot
        with pytest.raises(checkpoint.CheckpointError, match="not a converted"):
            checkpoint.register_shipped("other", tmp_path)
        with pytest.raises(checkpoint.CheckpointError, match="path separators"):
            checkpoint.register_shipped("a/b", tmp_path / "dst")
    finally:
        checkpoint.unregister_shipped("my-tiny")
    assert "my-tiny" not in checkpoint.shipped_models()
    assert checkpoint.read_config("tiny-llada")[0].family == "llada"


def test_convert_error_is_a_checkpoint_error():
    from asynclane_jax.checkpoint import CheckpointError

    assert issubclass(ConvertError, CheckpointError)  # so `asynclane-jax` prints it cleanly
