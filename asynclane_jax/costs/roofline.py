"""Seconds of a model call, a decode and its tokens per second on one chip or a slice:
a roofline.

One call takes max(FLOPs / peak, bytes / HBM bandwidth) + the chip's per-call
overhead, and on a slice of n chips the all-reduces besides. Compute and memory
traffic are taken to overlap perfectly, and the kernels to reach the datasheet peaks:
a projection is a lower bound on what the call costs (docs/costs.md says where it is
most uncertain).

Which peak: our int8 weights are weight-only (asynclane_jax.models.quantize): the
activations stay in the compute dtype and qwix's einsum multiplies them with the int8
values converted to that dtype, applying the scale to the output. The matmul runs on
the chip's bfloat16 units, so int8 weights halve the weight bytes and leave the
compute peak where it was (`matmul_peak`); the int8 peak of the table would apply only
to int8 activations as well, which the model does not have.

A slice (`chips=n`) is tensor-parallel, as Megatron-style sharding and our sharding
rules lay the model out: each chip holds and reads 1/n of every layer's kernels, of
the head and of the K/V cache, and computes 1/n of the matmuls and of the attention;
the norms, the embedding rows, the call's inputs and the [tokens, d] activation stream
are on every chip whole. Each layer sums its attention output and its MLP output
across the chips: two all-reduces per layer of the [tokens, d] activations, each
priced as a ring all-reduce, 2 (n - 1) / n of its bytes through the chip's link,
plus a fixed latency, not overlapped with compute. `heads="whole"` follows our
sharding rules (`asynclane_jax.sharding.rules_for`) where a count does not divide by
n: heads that do not divide keep the attention whole on every chip, K/V heads that do
not divide keep K/V (their projections and cache) whole, an MLP width or a vocabulary
that does not divide keeps that layer whole; `heads="ideal"` divides everything by n.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from asynclane_jax.costs.chips import Chip, CostError, get_chip
from asynclane_jax.costs.formula import CallCost, call_cost
from asynclane_jax.decoding.stats import CallShape
from asynclane_jax.models.config import ModelConfig

HEAD_POLICIES = ("ideal", "whole")


@dataclasses.dataclass(frozen=True)
class CallTiming:
    """One call's projected seconds on one chip of a slice, by term.

    Attributes:
      chip: the chip's key; chips: the slice's size.
      flops, bytes: what one chip computes and moves.
      compute_s: flops / the matmul peak; memory_s: bytes / HBM bandwidth.
      overhead_s: the chip's per-call overhead; collective_s: the all-reduces.
    """

    chip: str
    chips: int
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float
    collective_s: float

    @property
    def total(self) -> float:
        """max(compute, memory) + overhead + collectives."""
        return max(self.compute_s, self.memory_s) + self.overhead_s + self.collective_s

    @property
    def bound(self) -> str:
        """"compute" or "memory": the larger of the two roofline terms."""
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "bound": self.bound}


def matmul_peak(chip: Chip, weights: str) -> float:
    """The FLOP/s a call's matmuls are priced at: the bfloat16 peak for every weight
    format (int8 weights are weight-only: see the module docstring)."""
    del weights
    return chip.peak_bf16_flops


def _check_chips(chips) -> int:
    if isinstance(chips, bool) or not isinstance(chips, int) or chips < 1:
        raise CostError(f"chips={chips!r}: expected a positive integer")
    return chips


def per_chip(cost: CallCost, chips: int = 1, heads: str = "ideal") -> tuple[float, float]:
    """(FLOPs, bytes) one chip of a tensor-parallel slice computes and moves.

    Args:
      cost: the whole call's cost (`call_cost`).
      chips: the slice's size n.
      heads: "ideal" (everything sharded divides by n) or "whole" (our sharding
        rules: a head, K/V head, MLP or vocabulary count that n does not divide
        keeps its part whole on every chip).
    """
    n = _check_chips(chips)
    if heads not in HEAD_POLICIES:
        raise CostError(f"heads={heads!r}: expected one of {HEAD_POLICIES}")

    def split(count: int) -> int:
        return n if heads == "ideal" or count % n == 0 else 1

    attn = split(cost.heads)
    kv = attn if attn == 1 else split(cost.kv_heads)
    mlp, vocab = split(cost.mlp_hidden), split(cost.vocab)
    flops = ((cost.flops_qo + cost.flops_attention) / attn + cost.flops_kv / kv
             + cost.flops_mlp / mlp + cost.flops_head / vocab)
    moved = (cost.bytes_qo / attn + (cost.bytes_kv + cost.bytes_kv_read
                                     + cost.bytes_kv_write) / kv
             + cost.bytes_mlp / mlp + (cost.bytes_head + cost.bytes_logits) / vocab
             + cost.bytes_act_sharded / (1 if min(attn, mlp) == 1 else n)
             + cost.bytes_other + cost.bytes_act_full + cost.bytes_inputs)
    return flops, moved


def call_timing(chip, cost: CallCost, chips: int = 1, heads: str = "ideal") -> CallTiming:
    """The terms of one call's projected time (see `CallTiming`).

    Args:
      chip: a Chip or its key ("v5e", "v6e", "h200").
      cost: the call's cost (`call_cost`).
      chips: tensor-parallel slice size; heads: as `per_chip`.
    Raises:
      CostError: an unknown chip, a bad slice size or head policy.
    """
    chip = get_chip(chip)
    flops, moved = per_chip(cost, chips, heads)
    collective = 0.0
    if chips > 1:
        ring = 2.0 * (chips - 1) / chips * cost.allreduce_bytes / chip.link_bytes_per_s
        collective = ring + cost.allreduces * chip.collective_latency_s
    return CallTiming(chip=chip.key, chips=chips, flops=flops, bytes=moved,
                      compute_s=flops / matmul_peak(chip, cost.weights),
                      memory_s=moved / chip.hbm_bytes_per_s,
                      overhead_s=chip.call_overhead_s, collective_s=collective)


def call_time(chip, cost: CallCost, chips: int = 1, heads: str = "ideal") -> float:
    """Projected seconds of one call: max(flops / peak, bytes / bandwidth) + the chip's
    per-call overhead (+ the all-reduces of a slice). Arguments as `call_timing`."""
    return call_timing(chip, cost, chips, heads).total


def _counts(counts) -> list[tuple[CallShape, int]]:
    out = []
    for item in counts:
        try:
            shape, calls = item
        except (TypeError, ValueError):
            raise CostError(f"counts: expected (CallShape, calls) pairs, got {item!r}") \
                from None
        if not isinstance(shape, CallShape):
            raise CostError(f"counts: {shape!r} is not a CallShape")
        if isinstance(calls, bool) or int(calls) != calls or calls < 0:
            raise CostError(f"counts: {calls!r} calls of {shape}: expected a count >= 0")
        out.append((shape, int(calls)))
    return out


def decode_time(chip, cfg: ModelConfig, counts: Iterable[tuple[CallShape, int]],
                weights: str = "bf16", chips: int = 1, heads: str = "ideal") -> float:
    """Projected seconds of a decode's model calls: the sum over its call shapes of
    calls x one call's time.

    Args:
      chip: a Chip or its key, or measured costs (an object with `call_time(shape)`,
        such as `asynclane_jax.costs.measure.MeasuredCosts`: the "cpu" chip; weights,
        chips and heads are then those of the measured model and are ignored).
      cfg: the model's config.
      counts: [(CallShape, calls)], e.g. from a decode's stats.
      weights: the weight format (`call_cost`); chips, heads: as `call_timing`.
    Returns:
      Seconds (model calls only: the sampler's own work between calls is not priced).
    """
    counts = _counts(counts)
    if hasattr(chip, "call_time") and not isinstance(chip, (str, Chip)):
        return float(sum(calls * chip.call_time(shape) for shape, calls in counts if calls))
    chip = get_chip(chip)
    return float(sum(calls * call_time(chip, call_cost(cfg, shape, weights), chips, heads)
                     for shape, calls in counts if calls))


def tokens_per_s(chip, cfg: ModelConfig, counts: Iterable[tuple[CallShape, int]],
                 gen_tokens: float, weights: str = "bf16", chips: int = 1,
                 heads: str = "ideal") -> float:
    """Generated tokens per projected second of the decode's calls (`decode_time`);
    gen_tokens: the tokens the decode generated, every row together."""
    if gen_tokens < 0:
        raise CostError(f"gen_tokens={gen_tokens!r}: expected a count >= 0")
    seconds = decode_time(chip, cfg, counts, weights, chips, heads)
    if seconds <= 0:
        raise CostError("the decode made no model call: no time to divide by")
    return gen_tokens / seconds


__all__ = ["CallTiming", "HEAD_POLICIES", "call_time",
           "call_timing", "decode_time", "matmul_peak", "per_chip", "tokens_per_s"]
