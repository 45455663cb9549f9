"""Trains a tiny testbed model and ships it into the package.

  python experiments/train_testbed.py --model tiny-llada --minutes 55
  python experiments/train_testbed.py --model tiny-dream --minutes 55
  python experiments/train_testbed.py --model tiny-llada --task-set v2 --minutes 85
  python experiments/train_testbed.py --model tiny-llada --task-set v2 --minutes 75 \
      --init-from tiny-llada
  python experiments/train_testbed.py --objective causal --task-set v4 --minutes 85
  python experiments/train_testbed.py --objective block --task-set v4 --minutes 80

Checkpoints (resumable: rerun the same command) go under runs/<name>/; the loss curve
and the JSON log go to experiments/results/testbed/testbed_<name>.{png,json}; the final model is
written to asynclane_jax/testbed/models/<name>/ (unless --no-export).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny-llada", "tiny-dream"], default="tiny-llada")
    ap.add_argument("--task-set", choices=["v1", "v2", "v3", "v4"], default="v1",
                    help="v1: math and code (the first models); v2: adds the long chain and "
                         "list families, trained with length buckets (name <model>-v2); v3: "
                         "math, code and the long walk and table families (name <model>-v3); "
                         "v4: v3 with the labels of walk and table counting down to (1) "
                         "(name <model>-v4)")
    ap.add_argument("--objective", choices=["diffusion", "causal", "block"],
                    default="diffusion",
                    help="causal: the autoregressive baseline tiny-ar-v4 (task set v4 only; "
                         "next-token loss, causal attention, monitored with the ar "
                         "sampler); block: the LLaDA2-style mixture-of-experts model "
                         "tiny-llada2-v4 (task set v4 only; block-diffusion loss, "
                         "block-causal attention, monitored with the llada2 sampler; "
                         "--model and --init-from do not apply)")
    ap.add_argument("--minutes", type=float, default=55.0, help="wall-clock training budget")
    ap.add_argument("--steps", type=int, default=None, help="fixed step count instead")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--mlp-hidden", type=int, default=None)
    ap.add_argument("--qkv-bias", action=argparse.BooleanOptionalAction, default=None,
                    help="q/k/v projection biases (default: Dream yes, LLaDA no)")
    ap.add_argument("--t-max-start", type=float, default=None,
                    help="mask-ratio curriculum: largest t at the start (default 0.25)")
    ap.add_argument("--t-ramp", type=float, default=None,
                    help="fraction of the budget over which t_max rises to 1 "
                         "(default 0.2; 0 turns the curriculum off)")
    ap.add_argument("--long-frac", type=float, default=None,
                    help="share of batches with a 256/512-token response region "
                         "(default 0.08)")
    ap.add_argument("--bucket-weights", default=None, metavar="W,W,...",
                    help="relative weights of the length buckets' steps, in their order "
                         "(v3 / v4: response regions 64, 128, 256, 512; default "
                         "0.19,0.06,0.25,0.5)")
    ap.add_argument("--bucket-policy", choices=["smallest", "fits"], default=None,
                    help="v2: which problems a length bucket takes: only those whose "
                         "smallest bucket it is (default), or any that fits it (short "
                         "answers also train with long end-of-text tails)")
    ap.add_argument("--lines-curriculum", default=None, metavar="START,FROM,TO",
                    help="v2: at most START working lines in chain / list until progress "
                         "FROM, rising linearly to all at TO (e.g. 4,0,0.4)")
    ap.add_argument("--shuffle-statements", type=float, default=None, metavar="P",
                    help="v2: probability that a chain / list training problem lists its "
                         "statements in a random order, so they are found only by label "
                         "(default 0)")
    ap.add_argument("--family-weights", default=None, metavar="W,W,...",
                    help="relative weights of the task set's families in the training "
                         "stream, in its order (e.g. 1,1,3,3 for v4: math, code, "
                         "walk-down, table-down; default: uniform)")
    ap.add_argument("--name", default=None,
                    help="the run's and the shipped model's name (default: tiny-llada, "
                         "tiny-dream, or with -v2 for the task set v2)")
    ap.add_argument("--eval-every", type=float, default=600.0, help="seconds between monitors")
    ap.add_argument("--eval-n", type=int, default=None, help="problems per monitor (default 32)")
    ap.add_argument("--eval-gen-length", type=int, default=None,
                    help="monitor gen length (default 64; 512 for v2)")
    ap.add_argument("--init-from", default=None,
                    help="warm start: a shipped model's name or a converted folder; the run "
                         "takes its architecture and weights (new vocabulary ids start "
                         "random; a tiny-dream run may start from a LLaDA-style model and "
                         "learns the logit shift) and the model card says so")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-dir", default=None, help="default: runs/<model>")
    ap.add_argument("--export", default=None,
                    help="destination folder (default: the package's testbed/models/<model>)")
    ap.add_argument("--no-export", action="store_true")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--time-steps", type=int, default=0,
                    help="only time this many steps per batch shape, then exit")
    args = ap.parse_args(argv)

    from asynclane_jax.testbed import tokenizer as tok
    from asynclane_jax.testbed import train

    family = "llada" if args.model == "tiny-llada" else "dream"
    long_configs = {"v2": train.v2_config, "v3": train.v3_config, "v4": train.v4_config}
    if args.objective == "causal":
        if args.task_set != "v4":
            ap.error(f"--objective causal: the autoregressive baseline is trained on the "
                     f"task set v4 (--task-set v4), not {args.task_set}")
        long_configs["v4"] = train.ar_v4_config
    if args.objective == "block":
        if args.task_set != "v4":
            ap.error("--objective block: the LLaDA2-style model is trained on the task set "
                     "v4 (--task-set v4)")
        long_configs["v4"] = lambda family, **changes: train.llada2_v4_config(**changes)
    if args.task_set in long_configs:
        config = long_configs[args.task_set]

        def make(**changes):
            return config(family, **changes)
    else:
        make = train.llada_config if family == "llada" else train.dream_config
    changes = {"minutes": args.minutes, "steps": args.steps, "eval_every_s": args.eval_every,
               "seed": args.seed}
    if args.init_from:
        try:
            changes.update(train.source_architecture(args.init_from), init_from=args.init_from)
        except (OSError, ValueError) as e:
            ap.error(f"--init-from: {e}")
        if (changes["family"] == "llada2") != (args.objective == "block"):
            ap.error(f"--init-from {args.init_from}: a {changes['family']} model; a "
                     "llada2 model warm-starts a run of --objective block, and only it can")
        # The run keeps its own family: a Dream-style run may start from a LLaDA-style
        # model's weights (the parameter trees are the same; the logit shift is learned),
        # as Dream-7B started from an autoregressive model's.
        changes.pop("family")
    for field in ("lr", "d_model", "n_layers", "mlp_hidden", "qkv_bias", "t_max_start",
                  "t_ramp", "eval_n", "eval_gen_length", "bucket_policy", "shuffle_statements",
                  "name"):
        if getattr(args, field) is not None:
            changes[field] = getattr(args, field)
    if args.lines_curriculum is not None:
        try:
            start, ramp_from, ramp_to = (float(x) for x in args.lines_curriculum.split(","))
            if not (start >= 1 and 0 <= ramp_from < ramp_to <= 1):
                raise ValueError
        except ValueError:
            ap.error(f"--lines-curriculum {args.lines_curriculum}: expected START,FROM,TO "
                     "with START >= 1 and 0 <= FROM < TO <= 1")
        changes["lines_curriculum"] = (int(start), ramp_from, ramp_to)
    if args.shuffle_statements is not None and not 0 <= args.shuffle_statements <= 1:
        ap.error(f"--shuffle-statements {args.shuffle_statements:g}: expected a probability "
                 "from 0 to 1")
    if args.family_weights is not None:
        from asynclane_jax.testbed import tasks

        try:
            changes["family_weights"] = tasks.check_family_weights(
                args.family_weights.split(","), args.task_set)
        except ValueError as e:
            ap.error(f"--family-weights {args.family_weights}: {e}")
    tc = make(**changes)
    if args.long_frac is not None:
        try:
            tc = tc.with_long_frac(args.long_frac)
        except ValueError as e:
            ap.error(f"--long-frac: {e}")

    if args.bucket_weights is not None:
        try:
            tc = tc.with_bucket_probs(args.bucket_weights.split(","))
        except ValueError as e:
            ap.error(f"--bucket-weights {args.bucket_weights}: {e}")

    if args.time_steps:
        trainer = train.Trainer(tc)
        print(f"{tc.name}: {trainer.n_params:,} parameters")
        shapes = tc.buckets or [(tc.prompt_length, r, rows, p) for r, rows, p in tc.regions]
        for index, (p_len, region, rows, _) in enumerate(shapes):
            if tc.buckets:
                probs = [1.0 if i == index else 0.0 for i in range(len(shapes))]
                trainer.buckets.buckets = tuple(b[:3] + (q,) for b, q in zip(shapes, probs))
            else:
                trainer.tc = dataclasses.replace(tc, regions=((region, rows, 1.0),))
            trainer.train_step()  # compile
            t0 = time.perf_counter()
            for _ in range(args.time_steps):
                rec = trainer.train_step()
            dt = (time.perf_counter() - t0) / args.time_steps
            print(f"prompt {p_len} + region {region} x {rows} rows: {dt:.3f} s/step "
                  f"(loss {rec['loss']:.3f})", flush=True)
        if tc.buckets:
            trainer.buckets.buckets = tuple(tuple(b) for b in tc.buckets)
        trainer.tc = tc
        t0 = time.perf_counter()
        print(trainer.evaluate(), f"{time.perf_counter() - t0:.1f} s")
        return

    run_dir = pathlib.Path(args.run_dir or ROOT / "runs" / tc.name)
    trainer = train.Trainer(tc, run_dir)
    print(f"{tc.name}: {trainer.n_params:,} parameters; resuming at step {trainer.step}"
          if trainer.step else f"{tc.name}: {trainer.n_params:,} parameters", flush=True)
    trainer.fit(progress_bar=not args.no_progress, log=lambda s: print(s, flush=True))
    final = trainer.evaluate()
    print(f"[final monitor] {json.dumps(final)}", flush=True)

    results = ROOT / "experiments" / "results" / "testbed"
    results.mkdir(parents=True, exist_ok=True)
    log = trainer.log_dict()
    (results / f"testbed_{tc.name}.json").write_text(json.dumps(log, indent=1) + "\n")
    train.plot_run(log, results / f"testbed_{tc.name}.png")
    if not args.no_export:
        tok_dir = run_dir / "tokenizer"
        tok.save_tokenizer(tok_dir)
        dest = pathlib.Path(args.export) if args.export else (
            ROOT / "asynclane_jax" / "testbed" / "models" / tc.name)
        trainer.export(dest, tokenizer_dir=tok_dir, extra={"monitor": final})
        print(f"saved {dest}", flush=True)


if __name__ == "__main__":
    main()
