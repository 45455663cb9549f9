"""The chips a decode's cost is projected onto: one table of datasheet figures.

Every figure of `CHIPS` is the vendor's published peak for one chip, with the page it
comes from in `Chip.sources`. Two terms are not datasheet figures but assumptions of
this model, said so where they are set: `call_overhead_s` (the fixed cost of one model
call) and `collective_latency_s` (the fixed cost of one all-reduce in a slice).

A slice of n chips runs the model tensor-parallel (`asynclane_jax.costs.roofline`): each
chip holds and reads 1/n of the weights and of the K/V heads and computes 1/n of the
matmuls, and the layer outputs are summed across the chips by two all-reduces per layer
over the interconnect (`link_bytes_per_s`).
"""

from __future__ import annotations

import dataclasses

GB = 10**9
GIB = 2**30
TERA = 10**12

V5E_URL = "https://cloud.google.com/tpu/docs/v5e"
V6E_URL = "https://cloud.google.com/tpu/docs/v6e"
H200_URL = "https://www.nvidia.com/en-us/data-center/h200/"

# The figures a Chip must source (the assumptions are not among them).
SOURCED = ("peak_bf16_flops", "peak_int8_ops", "hbm_bytes_per_s", "hbm_bytes",
           "link_bytes_per_s")


class CostError(ValueError):
    """A chip, weight format, call shape or count the cost model cannot price."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip as the roofline sees it.

    Attributes:
      key: the table's key ("v5e", "v6e", "h200").
      name: the product's name.
      peak_bf16_flops: peak dense bfloat16 matmul FLOP/s.
      peak_int8_ops: peak dense int8 matmul OP/s (kept for reference: our int8 weights
        are multiplied at the bfloat16 peak, see `roofline.matmul_peak`).
      hbm_bytes_per_s: HBM bandwidth, bytes/s.
      hbm_bytes: HBM capacity, bytes.
      link_bytes_per_s: chip-to-chip bandwidth per chip in a slice (TPU ICI, NVLink),
        bytes/s, both directions together as the vendors state it.
      call_overhead_s: seconds of fixed cost per model call (an assumption, see CHIPS).
      collective_latency_s: seconds of fixed cost per all-reduce in a slice (an
        assumption, see CHIPS).
      sources: the public page of each sourced figure, by field name.
      notes: what was read on the page, and the choices made.
    """

    key: str
    name: str
    peak_bf16_flops: float
    peak_int8_ops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float
    call_overhead_s: float
    collective_latency_s: float
    sources: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    notes: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sources(url: str) -> dict:
    return dict.fromkeys(SOURCED, url)


CHIPS: dict[str, Chip] = {
    "v5e": Chip(
        key="v5e", name="Cloud TPU v5e",
        peak_bf16_flops=197 * TERA,
        peak_int8_ops=393 * TERA,
        hbm_bytes_per_s=819 * GB,
        # The page says 16 GB; the chip holds 16 GiB (what asynclane_jax.aot checks a
        # compiled program against).
        hbm_bytes=16 * GIB,
        # "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip): 400 GBps"
        # (an older revision of the page: "Interchip Interconnect BW: 1600 Gbps").
        link_bytes_per_s=400 * GB,
        # Assumption, not a datasheet figure: a call of an 8B model is several hundred
        # fused operations issued by the TPU's own sequencer inside the decode's
        # compiled while loop (no host launch), each with a fixed start-up of a
        # fraction of a microsecond, plus the loop iteration itself.
        call_overhead_s=50e-6,
        # Assumption: a small all-reduce over ICI within a slice.
        collective_latency_s=5e-6,
        sources=_sources(V5E_URL),
        notes="v5e page: peak compute per chip 197 TFLOPs bf16 and 393 TOPs int8; HBM2 16 "
              "GB at 819 GBps; bidirectional ICI 400 GBps per chip."),
    "v6e": Chip(
        key="v6e", name="Cloud TPU v6e (Trillium)",
        peak_bf16_flops=918 * TERA,
        peak_int8_ops=1836 * TERA,
        # The page has given 1640 GBps (current revisions: 1638 GBps; one table 1600).
        hbm_bytes_per_s=1640 * GB,
        hbm_bytes=32 * GIB,
        # "Bidirectional inter-chip interconnect (ICI) bandwidth (per chip): 800 GBps"
        # (an older revision: "3200 Gbps").
        link_bytes_per_s=800 * GB,
        call_overhead_s=50e-6,  # assumption, as for v5e
        collective_latency_s=5e-6,  # assumption, as for v5e
        sources=_sources(V6E_URL),
        notes="v6e page: peak compute per chip 918 TFLOPs bf16 and 1836 TOPs int8; HBM 32 "
              "GB at 1640 GBps; bidirectional ICI 800 GBps per chip."),
    "h200": Chip(
        key="h200", name="NVIDIA H200 SXM",
        # The page lists BFLOAT16 Tensor Core 1,979 TFLOPS and INT8 Tensor Core 3,958
        # TOPS "with sparsity"; dense is half of each.
        peak_bf16_flops=989.5 * TERA,
        peak_int8_ops=1979 * TERA,
        hbm_bytes_per_s=4.8 * TERA,
        hbm_bytes=141 * GB,
        # NVLink: 900 GB/s per GPU, both directions together.
        link_bytes_per_s=900 * GB,
        # Assumption, not a datasheet figure: XLA launches the call's kernels (several
        # hundred for an 8B model) from the host inside the while loop, each with a
        # launch gap of the order of a microsecond or more even when captured in a
        # CUDA graph; larger than a TPU's.
        call_overhead_s=300e-6,
        # Assumption: a small NCCL all-reduce across NVSwitch.
        collective_latency_s=10e-6,
        sources=_sources(H200_URL),
        notes="H200 page (SXM column): BFLOAT16 Tensor Core 1,979 TFLOPS and INT8 3,958 "
              "TOPS with sparsity (dense: half); 141 GB HBM3e at 4.8 TB/s; NVLink 900 "
              "GB/s."),
}


def get_chip(chip) -> Chip:
    """The Chip a key ("v5e", "v6e", "h200", any case) names, or the Chip itself.

    Raises:
      CostError naming the known chips.
    """
    if isinstance(chip, Chip):
        return chip
    key = chip.strip().lower() if isinstance(chip, str) else chip
    if key not in CHIPS:
        raise CostError(f"chip {chip!r}: expected one of {', '.join(CHIPS)} (or the "
                        "measured 'cpu' costs of asynclane_jax.costs.measure)")
    return CHIPS[key]


__all__ = ["CHIPS", "Chip", "CostError", "SOURCED", "get_chip"]
