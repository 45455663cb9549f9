"""The decode loop's carry."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from asynclane_jax.models.model import KVCache


@struct.dataclass
class DecodeState:
    """Everything that changes between iterations of the decode while_loop.

    Canvas layout per row: [left padding | prompt | generation], the generation region
    starting at the same column P (the bucketed prompt length) in every row, so
    generated position j lives at canvas column P + j.
    """

    canvas: jax.Array  # [b, T] int32 token ids; mask id where not yet committed
    commit_step: jax.Array  # [b, G] int32: the row's iteration that committed it, -1 if none
    block: jax.Array  # [b] int32 current block index; == num_blocks once the row is done
    step_in_block: jax.Array  # [b] int32 iterations the row has spent in its current block
    row_steps: jax.Array  # [b] int32 iterations in which the row was served by a model call
    row_full: jax.Array  # [b] int32 full forwards that served the row
    row_partial: jax.Array  # [b] int32 cached (partial) forwards that served the row
    step: jax.Array  # [] int32 loop iterations
    nfe_full: jax.Array  # [] int32 full forwards (one call = the whole batch)
    nfe_partial: jax.Array  # [] int32 cached forwards
    tokens_processed: jax.Array  # [] int32 query positions fed to the model, summed over rows
    rng: jax.Array  # PRNG key; folded with `step` each iteration, never reused
    cache: KVCache | None  # K/V of every canvas column, [L, b, T, K, h] x2, when cached
    policy_state: Any  # sampler-specific pytree
