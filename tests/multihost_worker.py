"""One host of a two-host decode on CPU (started twice by tests/models/test_sharding.py).

Usage: python tests/multihost_worker.py PROCESS_ID PORT MODEL SAMPLER MESH
Each process has 4 fake CPU devices; jax.distributed joins them into one 8-device
system; the model is loaded onto the global mesh and every process prints the gathered
tokens as one JSON line.
"""

import json
import os
import sys

process_id, port, model_name, sampler, mesh = sys.argv[1:6]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_default_matmul_precision", "highest")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                           process_id=int(process_id))

import asynclane_jax  # noqa: E402
from asynclane_jax import sharding  # noqa: E402
from asynclane_jax.decoding import generate  # noqa: E402
from asynclane_jax.testbed import evaluate, tasks  # noqa: E402

model, tok, cfg = asynclane_jax.load(model_name, mesh=mesh)
params = jax.tree.leaves(model)
res = generate(model, evaluate.prompts_for(tasks.heldout(4)), sampler=sampler,
               gen_length=64)
print(json.dumps({"process": jax.process_index(), "devices": jax.device_count(),
                  "local_devices": jax.local_device_count(),
                  "mesh": sharding.describe(sharding.mesh_of(model)),
                  "fully_addressable": all(p.is_fully_addressable for p in params),
                  "tokens": res.tokens.tolist()}), flush=True)
jax.distributed.shutdown()
