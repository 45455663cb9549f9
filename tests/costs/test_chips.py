"""asynclane_jax.costs.chips: every datasheet figure has its vendor's page."""

from __future__ import annotations

import pytest

from asynclane_jax import aot
from asynclane_jax.costs import CHIPS, Chip, CostError, get_chip
from asynclane_jax.costs.chips import SOURCED

VENDOR = {"v5e": "https://cloud.google.com/tpu/docs/v5e",
          "v6e": "https://cloud.google.com/tpu/docs/v6e",
          "h200": "https://www.nvidia.com/en-us/data-center/h200"}


def test_the_table_holds_the_three_chips():
    assert set(CHIPS) == {"v5e", "v6e", "h200"}
    assert all(chip.key == key for key, chip in CHIPS.items())


@pytest.mark.parametrize("key", sorted(CHIPS))
def test_every_figure_has_a_source(key):
    chip = CHIPS[key]
    assert set(chip.sources) == set(SOURCED)
    for field in SOURCED:
        value = getattr(chip, field)
        assert value > 0, field
        assert chip.sources[field].startswith(VENDOR[key]), (field, chip.sources[field])


@pytest.mark.parametrize("key", sorted(CHIPS))
def test_figures_are_plausible(key):
    """Orders of magnitude a typo would break: peaks in hundreds of TFLOP/s, HBM in
    TB/s and tens of GB, int8 twice the bfloat16 peak, the assumed overheads small."""
    chip = CHIPS[key]
    assert 1e14 < chip.peak_bf16_flops < 1e16
    assert chip.peak_int8_ops == pytest.approx(2 * chip.peak_bf16_flops, rel=0.01)
    assert 5e11 < chip.hbm_bytes_per_s < 1e13
    assert 1e10 < chip.hbm_bytes < 2e11
    assert 1e11 < chip.link_bytes_per_s < 1e13
    assert 0 < chip.call_overhead_s < 1e-3
    assert 0 < chip.collective_latency_s < 1e-4


@pytest.mark.parametrize("key", ["v5e", "v6e"])
def test_tpu_memory_agrees_with_aot(key):
    assert CHIPS[key].hbm_bytes == aot.GENERATIONS[key]["hbm_gib"] * 2**30


def test_lookup():
    assert get_chip("V6E") is CHIPS["v6e"]
    assert get_chip(CHIPS["h200"]) is CHIPS["h200"]
    assert isinstance(get_chip(" h200 "), Chip)


@pytest.mark.parametrize("bad", ["v4", "tpu", "", None, 5])
def test_unknown_chip(bad):
    with pytest.raises(CostError, match="v5e, v6e, h200"):
        get_chip(bad)
