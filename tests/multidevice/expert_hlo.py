"""What the expert-parallel tests read in a compiled program's HLO."""

from __future__ import annotations

import re

# The shape of each all-gather's result: `%x = f32[8,64,16]{...} all-gather(...)`.
_GATHERED = re.compile(r"= \w+(\[[\d,]*\])\S* all-gather(?:-start)?\(")


def assert_no_expert_kernel_gathered(hlo: str, cfg) -> None:
    """Expert parallelism, not a gather of the experts: no all-gather in the compiled
    program yields a whole stacked expert kernel [E, d, m] or [E, m, d]."""
    E, d, m = cfg.n_experts, cfg.d_model, cfg.moe_hidden
    gathered = set(_GATHERED.findall(hlo))
    assert not {f"[{E},{d},{m}]", f"[{E},{m},{d}]"} & gathered, sorted(gathered)
