"""`asynclane-jax aot` for the LLaDA2 mixture-of-experts model (issue 45 item 4), at the
tiny test size: the real TPU compiler (libtpu, the `tpu` extra) builds the decode with the
experts split along the tensor axis (expert parallelism) and the routed experts as grouped
matmuls (ragged dots); the expert-parallel layer (`sharding.routed_experts`) compiles
without gathering a stacked expert kernel on a chip. int8 (its experts quantized too) is
tested in tests/models/test_llada2_int8.py.
The llada2-mini compiles are too slow for the test run: experiments/compile_llada2.py
makes them.

The compiles run at the default matmul precision: under the test suite's "highest"
(tests/conftest.py) the TPU compiler's grouped-matmul kernel refuses bfloat16 operands
("Mosaic failed to compile TPU kernel: Bad lhs type", contract precision fp32 on bf16),
libtpu 0.0.42.1 / jax 0.10.2.
"""

import json
import re

import jax
import jax.numpy as jnp
import pytest

from asynclane_jax import aot, cli, sharding
from asynclane_jax.models import preset

needs_libtpu = pytest.mark.skipif(
    not aot.tpu_compiler_available(),
    reason="libtpu (the TPU compiler) is not installed: pip install -e '.[tpu]'")

TINY = "tiny-llada2-test"  # 8 experts [8, 32, 16], 4 query / 2 K/V heads, block-causal


@pytest.fixture
def default_precision():
    with jax.default_matmul_precision("default"):
        yield


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.usefixtures("default_precision")
def test_experts_split_over_a_v5e_slice():
    cfg = preset(TINY)
    report = aot.compile_for_topology(TINY, sampler="d2f", gen_length=64, batch=4,
                                      prompt_len=32, topology="v5e:2x4", mesh="tensor=8",
                                      dtype="bfloat16", keep_hlo=True)
    assert report.fits and report.chips == 8 and report.mesh == "data=1,fsdp=1,tensor=8"
    assert (report.experts, report.experts_per_chip) == (cfg.n_experts, 1)
    assert "experts: 8 routed per layer, 1 on each chip" in report.summary()
    assert report.peak_bytes > report.argument_bytes > 0 and report.compile_s > 0
    assert "ragged-dot" in report.hlo_text  # grouped matmuls, not a dense product
    assert "experts_per_chip" in json.loads(report.to_json())


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.usefixtures("default_precision")
def test_expert_parallel_layer_gathers_no_expert_kernel():
    """sharding.routed_experts (the shard_map over the expert axis) compiled for 8 v5e
    chips with the experts split 8 ways: ragged dots over each chip's own experts, one
    all-reduce, no stacked expert kernel gathered (the compiler's own partitioning of
    moe.routed_experts gathers all three whole: experiments/compile_llada2.py layer)."""
    cfg = preset(TINY)
    tpu = aot.tpu_slice("v5e:2x4")
    plan = sharding.plan_for(cfg, sharding.make_mesh("tensor=8", devices=list(tpu.devices)))
    E, d, m, k, n = cfg.n_experts, cfg.d_model, cfg.moe_hidden, cfg.n_experts_per_tok, 64
    rep, bf16 = plan.replicated(), jnp.bfloat16
    kernel = lambda *names: jax.ShapeDtypeStruct(
        (E, *(d if x == "embed" else m for x in names)), bf16,
        sharding=plan.sharding(("expert", *names), (E, *(d if x == "embed" else m
                                                          for x in names))))
    args = (jax.ShapeDtypeStruct((n, d), bf16, sharding=rep),
            jax.ShapeDtypeStruct((n, k), jnp.int32, sharding=rep),
            jax.ShapeDtypeStruct((n, k), jnp.float32, sharding=rep),
            kernel("embed", "mlp"), kernel("embed", "mlp"), kernel("mlp", "embed"))

    def run(*a):
        with sharding.use(plan):
            return sharding.routed_experts(*a, bf16)

    hlo = jax.jit(run).lower(*args).compile().as_text()
    gathered = set(re.findall(r"= \w+(\[[\d,]*\])\S* all-gather(?:-start)?\(", hlo))
    assert not {f"[{E},{d},{m}]", f"[{E},{m},{d}]"} & gathered, gathered
    assert aot.count_collectives(hlo)["all-reduce"] == 1
    assert "ragged-dot" in hlo


@pytest.mark.tpu_aot
@needs_libtpu
@pytest.mark.usefixtures("default_precision")
def test_cli_one_v6e_chip(capsys):
    rc = cli.main(["aot", "--preset", TINY, "--sampler", "d2f", "--gen-length", "64",
                   "--prompt", "32", "--topology", "v6e:1x1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"]
    assert out["experts"] == out["experts_per_chip"] == 8
    assert out["collectives"] == dict.fromkeys(aot.COLLECTIVES, 0)
    assert out["peak_bytes"] <= out["hbm_bytes"]
