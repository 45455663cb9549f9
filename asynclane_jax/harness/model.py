"""`AsyncLaneLM`: an lm-eval model (registered as "asynclane") that decodes with the
samplers of asynclane_jax.decoding.

  generate_until   requests are batched through `generate` (one compiled program per
                   generation length: every batch is padded to the longest prompt of
                   its task, in the requests' order, as `asynclane-jax eval` does), the
                   text cut at the first stop sequence (`until`); the chat template
                   when lm-eval applies one (--apply_chat_template / --chat).
  loglikelihood    Monte-Carlo estimate of the masked-diffusion bound on log p(continuation
                   | context), as LLaDA's own evaluation computes it: each sample masks a
                   number k of the continuation's L tokens (k stratified over the samples
                   of a batch) and adds -log p(masked tokens) * L / k; the estimate is minus
                   the mean. `is_greedy`: greedy decoding of L tokens after the context
                   (the vanilla sampler: one token per step, the most confident first,
                   as LLaDA's evaluation checks it) writes the continuation.
  loglikelihood_rolling  refused (perplexity tasks: wikitext, pile_*, ...).

Speed figures (asynclane_jax.testbed.evaluate.SpeedTally: tokens/s, model calls per
token, ...) are kept per task; `get_model_info()` returns them, and lm-eval writes that
into the results' "config".

From Python:
  lm = AsyncLaneLM(model="tiny-llada", sampler="fast-dllm", gen_length=256)
  lm_eval.simple_evaluate(model=lm, tasks=["testbed"], task_manager=task_manager())
"""

from __future__ import annotations

import collections
import logging
import sys

import numpy as np

from asynclane_jax.errors import UsageError
from asynclane_jax.harness import require

lm_eval_model = require("lm_eval.api.model")
lm_eval_registry = require("lm_eval.api.registry")

log = logging.getLogger(__name__)

DEFAULT_GEN_LENGTH = 256  # when neither the user nor the task names one
DEFAULT_BATCH_SIZE = 50  # prompts per generate call (as `asynclane-jax eval`)
DEFAULT_MC_SAMPLES = 128  # Monte-Carlo samples per loglikelihood request (LLaDA: 128)
DEFAULT_MC_BATCH = 32
ROLLING_TASKS = "perplexity tasks such as wikitext, pile_* or lambada's *_rolling variants"


class UnsupportedRequest(UsageError):
    """A request type this model does not serve."""


def cut_at_stop(text: str, until) -> str:
    """The text up to the first occurrence of any stop sequence."""
    end = len(text)
    for s in until or ():
        if s:
            i = text.find(s)
            if i != -1:
                end = min(end, i)
    return text[:end]


def _int_or_default(value, default: int) -> int:
    if value is None or value == "auto" or (isinstance(value, str) and value.startswith("auto")):
        return default
    return int(value)


@lm_eval_registry.register_model("asynclane", "asynclane-jax")
class AsyncLaneLM(lm_eval_model.LM):
    """An lm-eval model over asynclane_jax.generate (see the module docstring).

    Args:
      model: a shipped model name or converted folder (asynclane_jax.load), or a loaded
        DiffusionLM (then give `tokenizer`).
      sampler: a registered sampler name (default: the CLI's default sampler).
      gen_length: tokens generated per request; None: the task's max_gen_toks (else 256).
      batch_size: prompts per generate call.
      seed: PRNG seed of every generate call and of the Monte-Carlo masks.
      mesh: decode sharded over this mesh (see asynclane_jax.sharding).
      mc_samples, mc_batch: Monte-Carlo samples per loglikelihood request, and per call.
      progress: tqdm bars on stderr.
      tokenizer: the tokenizer when `model` is a loaded model.
      **sampler_options: the sampler's options (block_length, threshold, cache, ...).
    """

    def __init__(self, model="tiny-llada", sampler=None, gen_length=None, batch_size=None,
                 seed: int = 0, mesh=None, mc_samples: int = DEFAULT_MC_SAMPLES,
                 mc_batch: int = DEFAULT_MC_BATCH, progress: bool = True, tokenizer=None,
                 max_batch_size=None, device=None, **sampler_options):
        super().__init__()
        import asynclane_jax
        from asynclane_jax.decoding.api import make_schedule
        from asynclane_jax.decoding.registry import DEFAULT_SAMPLER

        if isinstance(model, str):
            self.model_name = model
            self.model, self.tokenizer, _ = asynclane_jax.load(model, mesh=mesh)
        else:
            self.model_name = type(model).__name__
            self.model, self.tokenizer = model, tokenizer
        if self.tokenizer is None:
            raise UsageError(f"model {self.model_name} has no tokenizer; lm-eval needs one")
        self.cfg = self.model.cfg
        if sampler is None:
            sampler = DEFAULT_SAMPLER
        self.sampler = sampler
        self.sampler_options = {k: v for k, v in sampler_options.items() if v is not None}
        self.gen_length = None if gen_length is None else int(gen_length)
        if self.gen_length is not None and self.gen_length <= 0:
            raise UsageError(f"gen_length {gen_length}: must be a positive number of tokens")
        # An unknown sampler or option fails here, before any request.
        make_schedule(sampler, gen_length=self.gen_length or DEFAULT_GEN_LENGTH,
                      **self.sampler_options)
        self.batch_size = _int_or_default(batch_size, DEFAULT_BATCH_SIZE)
        if self.batch_size <= 0:
            raise UsageError(f"batch_size {batch_size}: must be a positive number of prompts")
        self.seed = int(seed)
        self.mesh = mesh
        self.mc_samples, self.mc_batch = int(mc_samples), int(mc_batch)
        self.progress = bool(progress)
        self.speed: dict[str, object] = {}  # task name -> SpeedTally
        self._ll_fn = None

    # ------------------------------------------------------------------ text helpers

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or self.model_name

    def chat_template(self, chat_template=False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise UsageError(f"the tokenizer of {self.model_name} has no chat template")
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Token ids of a context: the tokenizer's own special tokens (a BOS) are added
        unless the text already starts with them (a chat template writes its own)."""
        bos = getattr(self.tokenizer, "bos_token", None)
        special = not (bos and text.startswith(bos))
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _fit(self, ids: list[int], gen_length: int) -> list[int]:
        room = self.cfg.max_seq_len - gen_length
        if room <= 0:
            raise UsageError(f"gen_length {gen_length} leaves no room for a prompt in the "
                             f"model's {self.cfg.max_seq_len} positions")
        if len(ids) > room:
            log.warning("a prompt of %d tokens is cut to its last %d", len(ids), room)
            ids = ids[-room:]
        return ids or [self.cfg.eos_token_id]

    # ------------------------------------------------------------------ generation

    def _tally(self, task: str):
        from asynclane_jax.testbed.evaluate import SpeedTally

        return self.speed.setdefault(task, SpeedTally())

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from asynclane_jax.decoding import generate

        if not requests:
            return []
        groups: dict[tuple, list[int]] = collections.defaultdict(list)
        for i, req in enumerate(requests):
            _, kwargs = req.args
            gen = self.gen_length or int(kwargs.get("max_gen_toks") or DEFAULT_GEN_LENGTH)
            task = getattr(req, "task_name", None) or "all"
            groups[(task, gen)].append(i)
        if any(req.args[1].get("do_sample") for req in requests):
            log.warning("do_sample / temperature of the task are ignored: the sampler "
                        "(%s) decides how tokens are chosen", self.sampler)
        out: list[str | None] = [None] * len(requests)
        bar = None
        if self.progress and not disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc=f"generate ({self.sampler})", unit="prompt",
                       file=sys.stderr, dynamic_ncols=True)
        try:
            for (task, gen), idx in groups.items():
                prompts = [self._fit(self.encode(requests[i].args[0]), gen) for i in idx]
                bucket = max(len(p) for p in prompts)  # one prompt shape per group
                tally = self._tally(task)
                for start in range(0, len(idx), self.batch_size):
                    chunk = idx[start:start + self.batch_size]
                    res = generate(self.model, prompts[start:start + self.batch_size],
                                   sampler=self.sampler, gen_length=gen, bucket=bucket,
                                   tokenizer=self.tokenizer, seed=self.seed, mesh=self.mesh,
                                   **self.sampler_options)
                    tally.add(res.stats)
                    for i, text in zip(chunk, res.text):
                        context, kwargs = requests[i].args
                        until = kwargs.get("until") or []
                        if isinstance(until, str):
                            until = [until]
                        out[i] = cut_at_stop(text, until)
                        self.cache_hook.add_partial("generate_until", (context, kwargs), out[i])
                    if bar is not None:
                        bar.update(len(chunk))
                        f = tally.figures()
                        bar.set_postfix_str(f"{task}: {f['tps']:.1f} tok/s, "
                                            f"{f['nfe_per_token']:.3f} calls/tok")
        finally:
            if bar is not None:
                bar.close()
        return out  # type: ignore[return-value]

    def speed_figures(self) -> dict:
        """{task: SpeedTally.figures()}, plus "all" over every task when there are
        several."""
        from asynclane_jax.testbed.evaluate import SpeedTally

        out = {task: t.figures() for task, t in self.speed.items()}
        if len(self.speed) > 1:
            total = SpeedTally()
            for t in self.speed.values():
                total.merge(t)
            out["all"] = total.figures()
        return out

    def get_model_info(self) -> dict:
        """Merged by lm-eval into the results' "config"."""
        return {"asynclane": {"model": self.model_name, "sampler": self.sampler,
                              "sampler_options": self.sampler_options,
                              "gen_length": self.gen_length, "batch_size": self.batch_size,
                              "seed": self.seed, "speed": self.speed_figures()}}

    # ------------------------------------------------------------------ likelihood

    def _loglik_fn(self):
        """A jitted (params, tokens, key_mask, index, targets, weights) -> sum of
        weights * log p(target) per row."""
        if self._ll_fn is None:
            import jax
            import jax.numpy as jnp
            from flax import nnx

            graphdef, params = nnx.split(self.model)

            @jax.jit
            def f(params, tokens, key_mask, index, targets, weights):
                model = nnx.merge(graphdef, params)
                logits = model(tokens, key_mask=key_mask, logits_index=index)
                logp = jax.nn.log_softmax(logits, axis=-1)
                picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
                return jnp.sum(picked * weights, axis=-1)

            self._ll_fn = (f, params)
        return self._ll_fn

    def _score(self, ctx: list[int], cont: list[int], rng) -> tuple[float, bool]:
        import jax.numpy as jnp

        from asynclane_jax.decoding.api import bucket_length

        cfg = self.cfg
        L = len(cont)
        seq = np.asarray(ctx + cont, np.int32)
        T = len(seq)
        if T > cfg.max_seq_len:
            raise UsageError(f"a loglikelihood request of {T} tokens exceeds the model's "
                             f"{cfg.max_seq_len} positions")
        Tb = min(bucket_length(T, 32), cfg.max_seq_len)
        Lb = bucket_length(L, 8)
        shift = 1 if cfg.logit_shift else 0
        cont_cols = np.arange(len(ctx), T)
        index = np.full((Lb,), cont_cols[-1] - shift, np.int32)
        index[:L] = cont_cols - shift  # the output that predicts each continuation token
        targets = np.zeros((Lb,), np.int32)
        targets[:L] = cont
        f, params = self._loglik_fn()

        def run(n_masked: np.ndarray, masks: np.ndarray):
            b = len(n_masked)
            tokens = np.full((b, Tb), cfg.pad_token_id, np.int32)
            tokens[:, :T] = seq
            tokens[:, len(ctx):T] = np.where(masks, cfg.mask_token_id, cont)
            key_mask = np.zeros((b, Tb), bool)
            key_mask[:, :T] = True
            weights = np.zeros((b, Lb), np.float32)
            weights[:, :L] = masks * (L / n_masked)[:, None]
            return np.asarray(f(params, jnp.asarray(tokens), jnp.asarray(key_mask),
                                jnp.asarray(np.broadcast_to(index, (b, Lb))),
                                jnp.asarray(np.broadcast_to(targets, (b, Lb))),
                                jnp.asarray(weights)))

        total, n = 0.0, 0
        while n < self.mc_samples:
            b = min(self.mc_batch, self.mc_samples - n)
            # Masked counts stratified over the batch (LLaDA's estimator), 1..L each.
            k = rng.integers(1, L + 1)
            n_masked = (np.round(k + np.arange(b) * (L / b)).astype(np.int64) % L) + 1
            masks = np.zeros((b, L), bool)
            for j, m in enumerate(n_masked):
                masks[j, rng.permutation(L)[:m]] = True
            total += float(run(n_masked.astype(np.float32), masks).sum())
            n += b
        return total / n, self._is_greedy(ctx, cont)

    def _is_greedy(self, ctx: list[int], cont: list[int]) -> bool:
        from asynclane_jax.decoding import generate

        L = len(cont)
        res = generate(self.model, [ctx], sampler="vanilla", gen_length=L, block_length=L,
                       steps=L, seed=self.seed, mesh=self.mesh)
        return res.tokens[0].tolist() == list(cont)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if not requests:
            return []
        rng = np.random.default_rng(self.seed)
        bar = None
        if self.progress and not disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc=f"loglikelihood ({self.mc_samples} samples)",
                       unit="request", file=sys.stderr, dynamic_ncols=True)
        out = []
        try:
            for req in requests:
                context, continuation = req.args
                # Spaces at the end of the context belong to the continuation.
                stripped = context.rstrip()
                continuation = context[len(stripped):] + continuation
                ctx = self.encode(stripped) if stripped else []
                cont = list(self.tokenizer.encode(continuation, add_special_tokens=False))
                if not cont:
                    raise UsageError(f"a loglikelihood request has an empty continuation "
                                     f"({continuation!r})")
                if not ctx:
                    ctx = [self.cfg.eos_token_id]
                res = self._score(ctx, cont, rng)
                out.append(res)
                self.cache_hook.add_partial("loglikelihood", (context, req.args[1]), res)
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise UnsupportedRequest(
            "asynclane: loglikelihood_rolling (the whole-text likelihood of "
            f"{ROLLING_TASKS}) is not served: a diffusion LM has no left-to-right "
            "likelihood; generation tasks (generate_until) and multiple-choice tasks "
            "(loglikelihood, by Monte-Carlo masking) are")
