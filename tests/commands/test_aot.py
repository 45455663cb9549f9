"""Ahead-of-time compile for a TPU slice (asynclane_jax.aot, `asynclane-jax aot`).

The tests marked tpu_aot run the real TPU compiler (libtpu, the `tpu` extra, which CI
installs) on this machine; no TPU is needed. They are skipped only when libtpu is not
installed. The others check the errors a user can make without libtpu.
"""

import argparse
import json
import warnings

import jax
import pytest

from asynclane_jax import aot, cli, compile_cache
from asynclane_jax.models import preset

needs_libtpu = pytest.mark.skipif(
    not aot.tpu_compiler_available(),
    reason="libtpu (the TPU compiler) is not installed: pip install -e '.[tpu]'")

# A small LLaDA-shaped model: 8 query / 4 K/V heads, so a 4-way tensor axis splits both.
SMALL = preset("llada-8b-instruct").replace(
    n_layers=2, d_model=256, n_heads=8, n_kv_heads=4, head_dim=32, mlp_hidden=512,
    vocab_size=1024, mask_token_id=1000, eos_token_id=1001, pad_token_id=1001,
    eot_token_id=1002, max_seq_len=512)

KEYS = {"topology", "mesh", "argument_bytes", "output_bytes", "temp_bytes", "code_bytes",
        "peak_bytes", "hbm_bytes", "fits", "compile_s", "collectives", "headroom_bytes"}


@pytest.mark.parametrize("text, message", [
    ("v5e-8", "GENERATION:SHAPE"),
    ("v9x:2x2", "unknown TPU generation"),
    ("v5e:2x4x1", "2 positive dimensions"),
    ("v4:2x2", "3 positive dimensions"),
    ("v5p:0x2x1", "3 positive dimensions"),
])
def test_bad_topology_strings(text, message):
    with pytest.raises(aot.AotError, match=message):
        aot.parse_topology(text)


def test_topology_strings():
    assert aot.parse_topology("v5e:2x4") == ("v5e", (2, 4))
    assert aot.parse_topology(" V4:2x2x1 ") == ("v4", (2, 2, 1))


def test_count_collectives():
    hlo = """
  %all-reduce.1 = bf16[8,128]{1,0} all-reduce(bf16[8,128]{1,0} %x), channel_id=1
  %ags = (bf16[4]{0}, bf16[8]{0}) all-gather-start(bf16[4]{0} %y), dimensions={0}
  %agd = bf16[8]{0} all-gather-done((bf16[4]{0}, bf16[8]{0}) %ags)
  %a2a = f32[2,4]{1,0:T(2,128)} all-to-all(f32[2,4]{1,0} %z), dimensions={0}
  %cp = u32[] collective-permute-start(u32[] %w), source_target_pairs={{0,1}}
  %rs = f32[4]{0} reduce-scatter(f32[8]{0} %v), dimensions={0}
  %add = f32[4]{0} add(f32[4]{0} %all-reduce.1, f32[4]{0} %rs)
"""
    assert aot.count_collectives(hlo) == {"all-reduce": 1, "all-gather": 1,
                                          "all-to-all": 1, "reduce-scatter": 1,
                                          "collective-permute": 1}


def test_missing_compiler_says_how_to_install(monkeypatch):
    monkeypatch.setattr(aot, "tpu_compiler_available", lambda: False)
    with pytest.raises(aot.AotError, match=r"pip install 'asynclane-jax\[tpu\]'"):
        aot.tpu_slice("v5e:2x4")


def test_cli_bad_topology_is_a_usage_error(capsys):
    rc = cli.main(["aot", "--preset", "tiny-llada-test", "--topology", "v5litepod-8"])
    assert rc == 2
    assert "GENERATION:SHAPE" in capsys.readouterr().err


@needs_libtpu
def test_cli_mesh_that_does_not_fit_the_torus_is_a_usage_error(capsys):
    # tensor=8 is no product of a 4x4 slice's physical axes (4 and 4).
    rc = cli.main(["aot", "--preset", "tiny-llada-test", "--topology", "v6e:4x4",
                   "--mesh", "data=2,tensor=8"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "data=2,fsdp=1,tensor=8" in err and "physical axes" in err
    assert "Traceback" not in err


@pytest.mark.tpu_aot
@needs_libtpu
def test_compile_for_v5e_slice():
    report = aot.compile_for_topology(SMALL, sampler="asynclane", gen_length=64, batch=8,
                                      prompt_len=32, topology="v5e:2x4",
                                      mesh="data=2,tensor=4")
    assert report.fits and not report.reason
    assert report.chips == 8 and report.device_kind == "TPU v5 lite"
    assert report.mesh == "data=2,fsdp=1,tensor=4"
    assert report.hbm_bytes == 16 * 2 ** 30
    for name in ("argument_bytes", "output_bytes", "code_bytes", "peak_bytes"):
        assert getattr(report, name) > 0, name
    assert report.temp_bytes >= 0
    # Per device: the weights are split four ways (data replicates them).
    assert report.argument_bytes < report.param_bytes / 2
    assert report.peak_bytes + report.headroom_bytes == report.hbm_bytes
    # Megatron-style tensor parallelism: all-reduces after attention and the MLP.
    assert report.collectives["all-reduce"] > 0
    assert KEYS <= set(json.loads(report.to_json()))


@pytest.mark.tpu_aot
@needs_libtpu
def test_compile_for_one_chip_has_no_collectives():
    report = aot.compile_for_topology(SMALL, sampler="fast-dllm", options={"cache": "dual"},
                                      gen_length=64, batch=1, prompt_len=32,
                                      topology="v6e:1x1", mesh="tensor")
    assert report.fits and report.chips == 1 and report.device_kind == "TPU v6 lite"
    assert report.hbm_bytes == 32 * 2 ** 30
    assert report.argument_bytes >= report.param_bytes
    assert not any(report.collectives.values())


@pytest.mark.tpu_aot
@needs_libtpu
def test_aot_compiles_with_the_persistent_cache_off(tmp_path):
    """JAX cannot load a program compiled for a TPU topology back from its persistent
    cache (it warns and compiles again), so aot writes nothing there, a second compile
    warns of nothing, the cache is as it was afterwards, and `aot` does not offer
    --compile-cache."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    before = jax.config.jax_compilation_cache_dir
    compile_cache.enable(tmp_path)
    cc.reset_cache()  # JAX reads the folder once per process
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*persistent compilation cache")
            for _ in range(2):
                aot.compile_for_topology(SMALL, sampler="vanilla", gen_length=64, batch=1,
                                         prompt_len=32, topology="v6e:1x1", mesh="tensor")
        assert not any(tmp_path.iterdir())
        assert jax.config.jax_enable_compilation_cache
        jax.jit(lambda x: x + 1)(jax.numpy.arange(3.0))  # the cache is back in use
        assert any(tmp_path.iterdir())
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
        cc.reset_cache()
    flags = {name: {s for a in p._actions for s in a.option_strings}
             for name, p in _subparsers().items()}
    assert "--compile-cache" not in flags["aot"] and "--compact-full" in flags["aot"]
    assert "--compile-cache" in flags["generate"]


def _subparsers() -> dict:
    parser = cli.build_parser()
    return next(a for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.tpu_aot
@needs_libtpu
def test_mesh_must_match_the_chips():
    with pytest.raises(aot.AotError, match="has 4 devices, but topology v5e:2x4 has 8"):
        aot.compile_for_topology(SMALL, topology="v5e:2x4", mesh="data=1,tensor=4")


@pytest.mark.tpu_aot
@needs_libtpu
def test_cli_json_and_does_not_fit(capsys):
    args = ["aot", "--preset", "tiny-llada-test", "--sampler", "fast-dllm", "--option",
            "cache=dual", "--gen-length", "32", "--batch", "8", "--prompt", "16",
            "--topology", "v5e:2x4", "--mesh", "data=2,tensor=4", "--json"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out) and out["fits"] is True
    assert out["options"] == {"cache": "dual"} and out["topology"] == "v5e:2x4"

    assert cli.main(args + ["--hbm-gib", "0.0001"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["fits"] is False and out["headroom_bytes"] < 0
    assert "does not fit on v5e:2x4" in captured.err and "MiB per chip" in captured.err
