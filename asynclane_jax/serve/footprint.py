"""The server's memory footprint from a model's config, without weights or allocation:
`asynclane-jax serve --dry-run`.

  asynclane-jax serve --dry-run --model llada-8b-instruct --slots 8 --max-tokens 512 \\
      --max-prompt 1024 --device-memory 141GiB [--quantize int8] [--json]

For the configured sampler, generation buckets, prompt buckets and slots it reports the
weights' bytes (the model's parameters as abstract arrays, quantized as `--quantize`
asks), each default pool's decode state (K/V cache, canvas and per-row counters, from
`jax.eval_shape` of the state the engine carries: `engine.pool_layout`; a pool per
generation bucket, prompt bucket and configuration, the server's own and each
`--allow-options` one whose program differs) at every slot count the engine compiles,
all default pools full at once, and the budget: --kv-budget, or the default the server
would take (half the free memory of a device of --device-memory bytes after the
weights; without it, this machine's devices or host).
`--model` is a converted folder, a shipped model or a preset name (llada-8b-instruct,
dream-7b-instruct, llada2-mini, ...): only its config is read.

A mixture-of-experts model (LLaDA2) is sized the same way: its weights are every array
of the model, all routed experts included (2 x 16,255,643,392 bytes for llada2-mini in
bfloat16), and its K/V cache is layers x K/V heads x head width per column, as a dense
model's. `--quantize int8` quantizes its `Linear` layers only (attention, dense and
shared-expert MLPs); the router and the stacked routed experts stay in the parameter
dtype, as the model holds them (docs/llada2.md).

Not counted: the chunk programs' temporaries (activations, logits) and the runtime's
own memory, which is why the default budget leaves half the free memory to them.
"""

from __future__ import annotations

import dataclasses
import json

from asynclane_jax.serve import budget as budget_lib
from asynclane_jax.serve.budget import size_text


@dataclasses.dataclass
class PoolFootprint:
    """One default pool: its generation and prompt buckets, the configuration it serves
    (the options an `--allow-options` configuration sets beyond the server's; {} for the
    server's own) and its state's bytes."""

    gen_length: int
    prompt_length: int
    fixed_bytes: int
    row_bytes: int  # per slot
    kv_row_bytes: int  # of which the K/V cache's
    bytes_at: dict  # slot count -> bytes of the state at that count
    config: dict = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> tuple:
        return (self.gen_length, self.prompt_length, tuple(sorted(self.config.items())))


@dataclasses.dataclass
class Footprint:
    """What a server of one model and configuration holds (see the module docstring)."""

    model: str
    dtype: str
    quantize: str
    sampler: str
    options: dict
    slots: int
    slot_buckets: tuple
    weight_bytes: int
    pools: list
    kv_budget: int
    budget_source: str
    device_bytes: int | None

    @property
    def all_full_bytes(self) -> int:
        """Every default pool's state at --slots at once (what the server held before
        budgets and buckets)."""
        return sum(p.bytes_at[self.slots] for p in self.pools)

    @property
    def rows_in_budget(self) -> dict:
        """A pool's key (gen_length, prompt_length, its configuration's options) -> the
        rows of that pool the budget holds alone."""
        return {p.key:
                max((self.kv_budget - p.fixed_bytes) // p.row_bytes, 0) if p.row_bytes else 0
                for p in self.pools}

    @property
    def problems(self) -> list[str]:
        out = []
        for p in self.pools:
            if p.bytes_at[1] > self.kv_budget:
                config = "".join(f", {k}={v}" for k, v in p.config.items())
                out.append(f"a request at generation length {p.gen_length} (prompt "
                           f"{p.prompt_length}{config}) needs {size_text(p.bytes_at[1])}, more "
                           f"than the budget {size_text(self.kv_budget)}: refused")
        if self.device_bytes is not None and \
                self.weight_bytes + self.kv_budget > self.device_bytes:
            out.append(f"weights {size_text(self.weight_bytes)} + budget "
                       f"{size_text(self.kv_budget)} exceed the device's "
                       f"{size_text(self.device_bytes)}")
        return out

    @property
    def fits(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["pools"] = [{**dataclasses.asdict(p),
                       "bytes_at": {str(k): v for k, v in p.bytes_at.items()}}
                      for p in self.pools]
        d.update(all_full_bytes=self.all_full_bytes, fits=self.fits,
                 problems=self.problems,
                 rows_in_budget=[{"gen_length": g, "prompt_length": n, "config": dict(c),
                                  "rows": r}
                                 for (g, n, c), r in self.rows_in_budget.items()])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def summary(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.items()) or "defaults"
        lines = [f"{self.model} ({self.dtype}, quantize {self.quantize}), sampler "
                 f"{self.sampler} ({opts}), up to {self.slots} slots per pool "
                 f"(slot counts {', '.join(map(str, self.slot_buckets))})",
                 f"weights: {size_text(self.weight_bytes)}",
                 "decode state per pool (K/V cache, canvas, per-row counters):"]
        rows = self.rows_in_budget
        for p in self.pools:
            at = ", ".join(f"{b}: {size_text(v)}" for b, v in p.bytes_at.items())
            config = "".join(f", {k}={v}" for k, v in p.config.items())
            lines.append(f"  gen {p.gen_length}, prompt {p.prompt_length}{config}: "
                         f"{size_text(p.row_bytes)} per slot (K/V "
                         f"{size_text(p.kv_row_bytes)}); at {at}; the budget holds "
                         f"{rows[p.key]} rows of it")
        lines.append(f"every default pool full at once: {size_text(self.all_full_bytes)}")
        lines.append(f"budget (--kv-budget): {size_text(self.kv_budget)} "
                     f"({self.budget_source})")
        total = self.weight_bytes + self.kv_budget
        device = "" if self.device_bytes is None else \
            f" of the device's {size_text(self.device_bytes)}"
        lines.append(f"weights + budget: {size_text(total)}{device}; the chunk programs' "
                     "temporaries and the runtime come on top")
        lines += self.problems or ["fits."]
        return "\n".join(lines)


def _config(model: str):
    from asynclane_jax.checkpoint.registry import read_config
    from asynclane_jax.errors import UsageError
    from asynclane_jax.models.config import PRESETS, preset

    if model in PRESETS:
        return preset(model)
    try:
        return read_config(model)[0]
    except Exception as e:  # not a folder, not shipped
        raise UsageError(f"--model {model}: neither a preset ({', '.join(sorted(PRESETS))}) "
                         f"nor a converted folder or shipped model ({type(e).__name__})") \
            from None


def footprint(model, *, sampler: str, options: dict | None = None, slots: int = 8,
              gen_lengths=(128, 256, 512), max_prompt: int | None = None,
              prompt_lengths=None, kv_budget: int | str | None = None,
              device_bytes: int | None = None, quantize: str | None = None,
              scan_layers: bool | None = None, dtype: str | None = None,
              allow_options=None) -> Footprint:
    """The footprint of `asynclane-jax serve` for a model (a preset name, a converted
    folder or shipped model, or a ModelConfig) and configuration; nothing is allocated.
    `allow_options`: the further configurations requests may pick (dicts of options
    over `options`, as `serve --allow-options` gives them); each whose program differs
    from one already counted adds its pools.

    Raises:
      EngineError: a bad sampler, option or bucket, a budget that cannot be read.
    """
    import dataclasses as dc

    from flax import nnx

    from asynclane_jax.decoding.api import make_schedule, prompt_bucket
    from asynclane_jax.decoding.schedule import SamplerError
    from asynclane_jax.models import ModelConfig, abstract_model
    from asynclane_jax.models import quantize as quantize_lib
    from asynclane_jax.serve.engine import (
        MAX_CONFIGS,
        EngineError,
        device_memory,
        pool_layout,
        prompt_buckets,
    )

    cfg = model if isinstance(model, ModelConfig) else _config(str(model))
    name = f"{cfg.family} config" if isinstance(model, ModelConfig) else str(model)
    if dtype is not None:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    if scan_layers is not None:
        cfg = cfg.replace(scan_layers=bool(scan_layers))
    mode = quantize_lib.check_mode(quantize)
    gens = tuple(sorted({int(g) for g in gen_lengths}))
    max_prompt, prompts = prompt_buckets(cfg, gens, max_prompt, prompt_lengths)
    graphdef, params = nnx.split(quantize_lib.abstract_quantized(abstract_model(cfg), mode))
    weights = quantize_lib.weight_bytes(params)
    buckets = budget_lib.slot_buckets(int(slots))
    pools = []
    configs = [{}] + [dict(c) for c in (allow_options or ())]
    if len(configs) > MAX_CONFIGS:  # as the server refuses them at start
        raise EngineError(f"allow_options: at most {MAX_CONFIGS - 1} configurations "
                          "besides the server's own (each a pool of its own)")
    for g in gens:
        seen = set()
        for extra in configs:
            try:
                schedule = make_schedule(sampler, gen_length=g, **{**(options or {}), **extra})
            except (SamplerError, TypeError, ValueError) as e:
                raise EngineError(f"{sampler}: {e}") from None
            if getattr(schedule, "delimiter_ids", ()) is None and \
                    getattr(schedule, "max_lanes", 1) != 1:
                # No tokenizer here for AsyncLane's newline ids: one stand-in id (as
                # `aot` does); the ids are constants, the state's shapes are the same.
                schedule = dc.replace(schedule, delimiters=str(cfg.eos_token_id))
            schedule = schedule.bind(None, cfg)
            if schedule.structure() in seen:  # the same program: the same pools
                continue
            seen.add(schedule.structure())
            for n in prompts:
                P = prompt_bucket(n, g, cfg, n)
                shape, _ = pool_layout(graphdef, params, schedule, (1, P + g),
                                       cfg.mask_token_id)
                pools.append(PoolFootprint(gen_length=g, prompt_length=P,
                                           fixed_bytes=shape.fixed, row_bytes=shape.per_row,
                                           kv_row_bytes=shape.kv_per_row,
                                           bytes_at={b: shape.bytes(b) for b in buckets},
                                           config=extra))
    if kv_budget is not None:
        try:
            budget, source = budget_lib.parse_bytes(kv_budget), "given"
        except budget_lib.BudgetError as e:
            raise EngineError(f"kv_budget {e}") from None
    elif device_bytes is not None:
        budget, source = budget_lib.default_budget(device_bytes, weights, None)
    else:
        limit, used = device_memory()
        budget, source = budget_lib.default_budget(
            limit, None if limit is None else (used or 0) + weights,
            budget_lib.host_memory_bytes())
        source += " on this machine"
    return Footprint(model=name, dtype=str(cfg.param_dtype), quantize=mode or "none",
                     sampler=sampler, options=dict(options or {}), slots=int(slots),
                     slot_buckets=buckets, weight_bytes=weights, pools=pools,
                     kv_budget=budget, budget_source=source, device_bytes=device_bytes)
