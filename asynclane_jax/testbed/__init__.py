"""The testbed: synthetic reasoning tasks, their tokenizer, a masked-diffusion trainer,
and the tiny LLaDA- and Dream-style models shipped in models/ (load them by name:
`asynclane_jax.load("tiny-llada")`).

  tasks.py         problems with exact answers (math word problems, program traces)
  tokenizer.py     word-level vocabulary, saved as a Hugging Face tokenizer.json
  words.py         the words the tasks are written in (read by tasks and tokenizer)
  train.py         LLaDA / Dream masked-diffusion objective, optax + orbax trainer
  evaluate.py      held-out exact-match accuracy through asynclane_jax.decoding.generate
                   (`from asynclane_jax.testbed.evaluate import evaluate`)
  card.py          model cards of the shipped models
  routers.py       Early-Bird's LBS and LPS routers (sampler "eb"): modules, decode
                   traces, training, the weights shipped beside a model (routers/)
"""

from asynclane_jax.testbed.tasks import Problem, check, heldout, line_accuracy, split

__all__ = ["Problem", "check", "heldout", "line_accuracy", "split"]
