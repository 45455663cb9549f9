"""A per-chip roofline cost model of the decode's model calls.

    from asynclane_jax.costs import call_cost, decode_time, tokens_per_s
    cost = call_cost(preset("llada-8b-instruct"), shape, weights="int8")
    seconds = decode_time("v6e", cfg, [(shape, calls), ...], weights="int8", chips=1)

* `chips`: the chips (TPU v5e, TPU v6e, NVIDIA H200) and their datasheet figures, each
  with its source;
* `formula`: FLOPs and HBM bytes of one call of a `CallShape` (`call_cost`);
* `roofline`: seconds of a call, of a decode's calls, and tokens per second;
* `measure`: the measured "cpu" chip, one call of each shape timed on this machine.

docs/costs.md describes the model and what it leaves out.
"""

from asynclane_jax.costs.chips import CHIPS, Chip, CostError, get_chip
from asynclane_jax.costs.formula import WEIGHT_BYTES, CallCost, call_cost
from asynclane_jax.costs.roofline import (
    CallTiming,
    call_time,
    call_timing,
    decode_time,
    matmul_peak,
    per_chip,
    tokens_per_s,
)

__all__ = ["CHIPS", "CallCost", "CallTiming", "Chip", "CostError", "WEIGHT_BYTES",
           "call_cost", "call_time", "call_timing", "decode_time", "get_chip",
           "matmul_peak", "per_chip", "tokens_per_s"]
