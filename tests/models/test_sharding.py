"""Sharding: mesh specs and rules on one device here; everything that needs 8 devices
runs in tests/multidevice/ in a separate pytest process started below."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from asynclane_jax import sharding

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/


@pytest.mark.sharding
@pytest.mark.slow
def test_multidevice_suite():
    """Runs tests/multidevice on 8 fake CPU devices; every test there must pass."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "multidevice")], env=env, cwd=HERE.parent,
                          capture_output=True, text=True, timeout=1500)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, tail


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.sharding
@pytest.mark.slow
def test_two_hosts_decode_like_one():
    """Two processes with 4 CPU devices each, joined by jax.distributed into one
    8-device mesh: each loads its own shards, both get the tokens one device gets."""
    import asynclane_jax
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import evaluate, tasks

    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(i),
                               port, "tiny-llada", "asynclane", "data=2,tensor=4"],
                              env=env, cwd=HERE.parent, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-4000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    model, _, _ = asynclane_jax.load("tiny-llada")
    one = generate(model, evaluate.prompts_for(tasks.heldout(4)), sampler="asynclane",
                   gen_length=64)
    for i, o in enumerate(outs):
        assert (o["process"], o["devices"], o["local_devices"]) == (i, 8, 4)
        assert o["mesh"] == "data=2,fsdp=1,tensor=4"
        assert not o["fully_addressable"]  # each host holds only its own shards
        assert o["tokens"] == one.tokens.tolist()


def _abstract_mesh(data=1, fsdp=1, tensor=1):
    from jax.sharding import AbstractMesh

    return AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES)


def test_mesh_specs():
    assert sharding.parse_mesh_spec("data=2,tensor=4", 8) == {"data": 2, "fsdp": 1,
                                                             "tensor": 4}
    assert sharding.parse_mesh_spec("tensor", 8) == {"data": 1, "fsdp": 1, "tensor": 8}
    assert sharding.parse_mesh_spec("data=-1, tensor=2", 8)["data"] == 4
    for bad, match in [("data=3", "3 devices, but there are 8"), ("model=8", "AXIS=SIZE"),
                       ("data=-1,tensor=-1", "only one axis"), ("data=x", "not an integer"),
                       ("data=2,data=4", "twice"), ("tensor=-1,data=3", "do not divide"),
                       ("", "names no axis"), ("data=0,tensor=8", "positive")]:
        with pytest.raises(sharding.ShardingError, match=match):
            sharding.parse_mesh_spec(bad, 8)
    assert sharding.make_mesh(None) is None


def test_rules_place_whole_heads():
    """LLaDA-8B (32/32 heads) splits attention 8 ways; Dream-7B (28/4) on 8 ways keeps
    attention whole on every device and splits the MLP and vocabulary, on 4 ways splits
    both; 'split' cuts inside heads as a plain table would."""
    from asynclane_jax.models import abstract_model, preset

    def specs(name, heads="whole", **mesh):
        cfg = preset(name)
        plan = sharding.ShardingPlan(_abstract_mesh(**mesh),
                                     sharding.rules_for(cfg, _abstract_mesh(**mesh),
                                                        heads=heads))
        state = nnx.state(abstract_model(cfg), nnx.Param)
        out = plan.param_shardings(state)
        attn, mlp = out["layers"][0]["attn"], out["layers"][0]["mlp"]
        cache = plan.spec(sharding.CACHE, (cfg.n_layers, 8, 640, cfg.n_kv_heads,
                                           cfg.head_dim))
        return (attn["q_proj"]["kernel"].get_value().spec,
                attn["k_proj"]["kernel"].get_value().spec,
                mlp["up_proj"]["kernel"].get_value().spec, out["embed"].get_value().spec, cache)

    q, k, up, embed, cache = specs("llada-8b-instruct", tensor=8)
    assert (q, k, up, embed) == (P(None, "tensor"),) * 3 + (P("tensor", None),)
    assert cache == P(None, None, None, "tensor", None)
    q, k, up, embed, cache = specs("dream-7b-instruct", tensor=8)
    assert (q, k, up) == (P(None, None), P(None, None), P(None, "tensor"))
    assert cache == P(None, None, None, None, None)
    q, k, up, embed, cache = specs("dream-7b-instruct", data=2, tensor=4)
    assert (q, k, up) == (P(None, "tensor"),) * 3
    assert cache == P(None, "data", None, "tensor", None)
    q, k, *_ = specs("dream-7b-instruct", heads="split", tensor=8)
    assert (q, k) == (P(None, "tensor"),) * 2
    q, k, up, embed, _ = specs("llada-8b-instruct", fsdp=2, tensor=4)
    assert (q, embed) == (P("fsdp", "tensor"), P("tensor", "fsdp"))
    with pytest.raises(sharding.ShardingError, match="heads="):
        sharding.rules_for(preset("tiny-llada-test"), _abstract_mesh(), heads="pad")


def test_no_plan_means_no_constraint():
    x = jax.numpy.ones((2, 3))
    assert sharding.active() is None and sharding.constrain(x, sharding.TOKENS) is x


def test_cli_mesh_errors_are_one_line(capsys):
    from asynclane_jax.cli import main

    rc = main(["generate", "ann has 7 coins . how many coins ?", "--mesh", "data=3"])
    err = capsys.readouterr().err
    assert rc == 2 and "mesh 'data=3' has 3 devices, but there are 1" in err
    assert "Traceback" not in err
