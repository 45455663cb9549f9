"""`asynclane-jax bench`: samplers side by side on the testbed's held-out problems.

  asynclane-jax bench --model tiny-llada --samplers vanilla,fast-dllm,localleap \\
      --gen-lengths 128,256,512 --n 50 [--batch 1] [--json FILE] [--plot FILE.png]

The command and its JSON:
  spec.py     the sampler specs: grammar (`NAME:key=a|b@MODEL`), defaults, validation
  runner.py   the timing loop (warm-up, then batches interleaved, each in its own order),
              the tally, the rows and the JSON file
  table.py    the printed table
  cli.py      the command (`register`, `main`)
The research comparison, a step the command runs on the runner's rows:
  compare.py  the three comparisons, (a) published, (b) early stop, (c) equal footing,
              and the speed-ups over the fastest baseline of each; a sampler's schedule
              class declares what the rules read (`footing_options`, `under_study`)
  report.py   the markdown report of a results file, with its breakdowns, and the plot
"""

from asynclane_jax.bench.cli import main, register

__all__ = ["main", "register"]
