"""LLaDA2-mini on TPU slices, compiled ahead of time (no TPU, no weights; needs the tpu
extra): what each chip must hold, and what the expert-parallel layer saves
(issue 45 item 4). Results: experiments/results/compile/llada2.md.

  python experiments/compile_llada2.py layer --out layer.jsonl
      one mixture-of-experts layer at llada2-mini's shape (256 experts [2048, 512],
      top-8, bfloat16), its routed experts compiled for each LAYER_CASES slice two ways:
      `moe.routed_experts` left to the compiler's partitioning (what the model called
      before it called sharding.routed_experts) and `sharding.routed_experts` (the
      shard_map over the expert axis); per-chip sizes, collectives, the shapes the
      program all-gathers, the grouped-matmul kernels (`ragged_dots`: the TPU
      compiler's ragged-dot custom calls). Seconds per compile.
  python experiments/compile_llada2.py rows --out rows.jsonl [--hook] [--layers N]
      [--limit N]
      the whole decode (`aot.compile_for_topology`, as `asynclane-jax aot` builds it) of
      llada2-mini for each row of ROWS not yet in the file, one at a time, appending
      {"command": ..., "hook": ..., **report}. --hook: SparseMoE calling
      sharding.routed_experts, as the model does; without it, moe.routed_experts (the
      compiler's partitioning) put in place for this process only. --layers N: the
      preset cut to N layers (timing probes). Each full row takes minutes of CPU and
      several GiB of host memory.
  python experiments/compile_llada2.py table --layer layer.jsonl [--rows rows.jsonl]
      the markdown tables of the results page.

Commands of the rows with the hook are `asynclane-jax aot ...` command lines (the
`command` field; the model calls sharding.routed_experts); rows without it have no
command-line equivalent (the model no longer calls moe.routed_experts itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import pathlib
import re
import shlex
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parent / "results" / "compile"
GIB = 2 ** 30
LAYER_CASES = [("v5e:2x4", "tensor=8", 1024), ("v5e:2x4", "data=2,tensor=4", 1024),
               ("v6e:1x1", "tensor", 1024)]
# (topology, mesh, batch). llada2-mini is 30.3 GiB of bfloat16 weights: one v6e chip
# (32 GiB) is the edge; a v5e-8 holds 1/8 of the experts per chip.
ROWS = [("v5e:2x4", "tensor=8", 1), ("v5e:2x4", "tensor=8", 8), ("v6e:1x1", "tensor", 1),
        ("v5e:2x4", "data=2,tensor=4", 8)]
SAMPLER, GEN, PROMPT = "d2f", 256, 128


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@contextlib.contextmanager
def hooked(on: bool):
    """SparseMoE calling sharding.routed_experts (on: as the model does) or, off,
    moe.routed_experts (the compiler's own partitioning of the ragged dots) while the
    block runs."""
    if on:
        yield
        return
    from asynclane_jax import sharding
    from asynclane_jax.models import moe

    saved = sharding.routed_experts
    sharding.routed_experts = moe.routed_experts
    try:
        yield
    finally:
        sharding.routed_experts = saved


def layer_case(topology: str, mesh: str, tokens: int, expert_parallel: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from asynclane_jax import aot, sharding
    from asynclane_jax.models import moe, preset

    cfg = preset("llada2-mini")
    tpu = aot.tpu_slice(topology)
    plan = sharding.plan_for(cfg, sharding.make_mesh(mesh, devices=list(tpu.devices)))
    E, d, m, k = cfg.n_experts, cfg.d_model, cfg.moe_hidden, cfg.n_experts_per_tok
    bf16, rep = jnp.bfloat16, plan.replicated()
    S = jax.ShapeDtypeStruct

    def kernel(names, shape):
        return S(shape, bf16, sharding=plan.sharding(names, shape))

    args = (S((tokens, d), bf16, sharding=rep), S((tokens, k), jnp.int32, sharding=rep),
            S((tokens, k), jnp.float32, sharding=rep),
            kernel(("expert", "embed", "mlp"), (E, d, m)),
            kernel(("expert", "embed", "mlp"), (E, d, m)),
            kernel(("expert", "mlp", "embed"), (E, m, d)))
    fn = sharding.routed_experts if expert_parallel else moe.routed_experts

    def run(*a):
        with sharding.use(plan):
            return fn(*a, bf16)

    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(*args).compile()
    seconds = time.perf_counter() - t0
    hlo = compiled.as_text()
    mem = compiled.memory_analysis()
    return dict(
        topology=topology, mesh=sharding.describe(plan.mesh), tokens=tokens,
        layer="sharding.routed_experts" if expert_parallel else "moe.routed_experts",
        experts_per_chip=E // math.prod(plan.mesh.shape[a] for a in plan.expert_axes(E)),
        argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes, code_bytes=mem.generated_code_size_in_bytes,
        collectives=aot.count_collectives(hlo),
        all_gathered=sorted(set(re.findall(r"= \w+(\[[\d,]*\])\S* all-gather(?:-start)?\(",
                                           hlo))),
        ragged_dots=len(re.findall(r"%ragged-dot-(?!metadata)[\w.-]* = ", hlo)),
        compile_s=round(seconds, 2),
        jax=jax.__version__, commit=_commit())


def cmd_layer(args) -> None:
    out = pathlib.Path(args.out)
    with out.open("a") as f:
        for topology, mesh, tokens in LAYER_CASES:
            for ep in (False, True):
                row = layer_case(topology, mesh, tokens, ep)
                print(json.dumps(row), flush=True)
                f.write(json.dumps(row) + "\n")


def _command(topology, mesh, batch) -> str:
    return shlex.join(["asynclane-jax", "aot", "--preset", "llada2-mini", "--sampler",
                       SAMPLER, "--gen-length", str(GEN), "--batch", str(batch), "--prompt",
                       str(PROMPT), "--topology", topology, "--mesh", mesh, "--json"])


def cmd_rows(args) -> None:
    from asynclane_jax import aot
    from asynclane_jax.models import preset

    out = pathlib.Path(args.out)
    done = set()
    if out.exists():
        done = {(r["command"], r["hook"])
                for r in map(json.loads, out.read_text().splitlines())}
    model = preset("llada2-mini")
    if args.layers:
        model = model.replace(n_layers=args.layers,
                              first_dense_layers=min(model.first_dense_layers,
                                                     args.layers - 1))
    for topology, mesh, batch in ROWS[:args.limit]:
        command = _command(topology, mesh, batch)
        if args.layers:
            command += f"  # cut to {args.layers} layers"
        if (command, args.hook) in done:
            continue
        with hooked(args.hook):
            report = aot.compile_for_topology(
                model, sampler=SAMPLER, gen_length=GEN, batch=batch, prompt_len=PROMPT,
                topology=topology, mesh=mesh, dtype="bfloat16")
        row = {"command": command, "hook": args.hook, "commit": _commit(),
               **report.to_dict()}
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")


def _g(b) -> str:
    return "-" if b is None else f"{b / GIB:.2f}"


def cmd_table(args) -> None:
    from asynclane_jax import aot

    rows = [json.loads(x) for x in pathlib.Path(args.layer).read_text().splitlines()]
    print("| slice | mesh | routed experts computed by | experts per chip | arguments "
          "| temporaries | code | compile s | collectives | all-gathered shapes |")
    print("|---|---|---|--:|--:|--:|--:|--:|---|---|")
    for r in rows:
        print(f"| {r['topology']} | {r['mesh']} | `{r['layer']}` | {r['experts_per_chip']} "
              f"| {_g(r['argument_bytes'])} | {_g(r['temp_bytes'])} | {_g(r['code_bytes'])} "
              f"| {r['compile_s']} | {aot.collectives_brief(r['collectives'])} "
              f"| {' '.join(r['all_gathered']) or 'none'} |")
    if args.rows:
        print()
        print("| command | hook | chips | experts per chip | arguments | temporaries | code "
              "| peak | headroom | fits | compile s | collectives |")
        print("|---|---|--:|--:|--:|--:|--:|--:|--:|---|--:|---|")
        for line in pathlib.Path(args.rows).read_text().splitlines():
            r = json.loads(line)
            print(f"| `{r['command']}` | {'yes' if r['hook'] else 'no'} | {r['chips']} "
                  f"| {r.get('experts_per_chip')} | {_g(r['argument_bytes'])} "
                  f"| {_g(r['temp_bytes'])} | {_g(r['code_bytes'])} | {_g(r['peak_bytes'])} "
                  f"| {_g(r['headroom_bytes'])} | {'yes' if r['fits'] else 'no: ' + r['reason']} "
                  f"| {r['compile_s']} | {aot.collectives_brief(r['collectives'])} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("layer")
    a.add_argument("--out", required=True)
    a.set_defaults(func=cmd_layer)
    a = sub.add_parser("rows")
    a.add_argument("--out", required=True)
    a.add_argument("--hook", action="store_true")
    a.add_argument("--layers", type=int, default=None)
    a.add_argument("--limit", type=int, default=None, help="only the first N rows")
    a.set_defaults(func=cmd_rows)
    a = sub.add_parser("table")
    a.add_argument("--layer", required=True)
    a.add_argument("--rows", default=None)
    a.set_defaults(func=cmd_table)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    sys.exit(main())
