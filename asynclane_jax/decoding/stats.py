"""The statistics every decode returns."""

from __future__ import annotations

import dataclasses

import numpy as np

# The most distinct call shapes one compiled decode may make (the size of its counters).
MAX_CALL_SHAPES = 16
CALL_KINDS = ("full", "cached", "mixed")


@dataclasses.dataclass(frozen=True)
class CallShape:
    """The static shape of one kind of model call a compiled decode makes.

    Every model call of a decode is one of a few shapes fixed when the program is
    traced (a full forward over the canvas or over its leading columns; a cached call
    of the schedule's query count, narrow or wide, against all keys or the leading
    ones). The decode counts the calls of each shape in its loop state
    (`DecodeStats.shape_calls`); a cost model prices each shape once.

    Attributes:
      kind: "full" (every column of the first `queries` encoded) or "cached" (the
        planned columns against the K/V cache).
      rows: rows the call computes (the batch bucket; twice that with classifier-free
        guidance), served or not.
      queries: query columns per row.
      keys: key columns per row the attention is computed over (the canvas T, or the
        schedule's key bound).
      logits: columns per row whose output head is computed.
      cache: whether the call writes its K/V into a cache (and, cached, reads it).
      canvas: T, the canvas length of the decode.
      full_rows: "mixed" only: the rows of its full-forward part. A mixed call is a
        cached call of `rows` rows (those it serves by the cached call, the others'
        queries computed and dropped) and a full forward over the whole canvas of
        `full_rows` other rows, in one pass over the weights
        (`DiffusionLM.forward_mixed`); its logits are `logits` columns per row of
        both parts.
    """

    kind: str
    rows: int
    queries: int
    keys: int
    logits: int
    cache: bool
    canvas: int
    full_rows: int = 0

    def __post_init__(self):
        if self.kind not in CALL_KINDS:
            raise ValueError(f"call kind {self.kind!r}: expected one of {CALL_KINDS}")
        if (self.kind == "mixed") != (self.full_rows > 0):
            raise ValueError(f"{self}: a mixed call, and only one, has full_rows")

    def parts(self) -> tuple[CallShape, ...]:
        """The calls a call of this shape does the work of: a mixed call's full forward
        (`full_rows` rows over the canvas, as many logits) and cached call; any other
        call itself."""
        if self.kind != "mixed":
            return (self,)
        T = self.canvas
        return (CallShape("full", self.full_rows, T, T, self.logits, True, T),
                dataclasses.replace(self, kind="cached", full_rows=0))

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if not self.full_rows:  # the fields of a full or cached call, as before mixed calls
            del out["full_rows"]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> CallShape:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)
                      if f.name in d or f.default is dataclasses.MISSING})


@dataclasses.dataclass
class DecodeStats:
    """Statistics of one `generate` call (schedules extend it with their own figures).

    Reads like a dict too (`stats["nfe_full"]`); `to_dict()` is what `--json` prints.

    Attributes:
      sampler: the sampler's name; options: its settings.
      steps: iterations of the slowest row; row_steps: [b] iterations serving each row.
      iterations: loop iterations (a batch runs as long as its slowest row).
      nfe, nfe_full, nfe_partial: model calls (full forwards, cached calls), per batch;
        a mixed call (a full forward of some rows and a cached call of the others in
        one call) counts in nfe_full.
      row_nfe_full, row_nfe_partial: [b] calls that served each row.
      tokens_processed: query positions fed to the model, summed over rows.
      commit_step: [b, G] the row iteration that committed each generated position.
      generated_tokens: [b] tokens before the first end-of-text.
      prompt_bucket, batch_bucket: the compiled shape (prompt length P, rows).
      compiled: whether this call compiled the program (else it was reused).
      compile_time, decode_time: seconds compiling (0 when reused) and decoding.
      hit_step_cap: a row was still unfinished at the loop's step cap (a bug signal).
      call_shapes: the shapes of the program's model calls (CallShape), in the order of
        the counters below.
      shape_calls: [S] calls of each shape, per batch.
      row_shape_calls: [b, S] calls of each shape that served each row.
      row_shape_keys: [b, S] key columns each row attended in its calls of each shape,
        summed (at most the shape's `keys` per call: a schedule's view can hide more).
    """

    sampler: str
    options: dict
    steps: int
    row_steps: np.ndarray
    iterations: int
    nfe: int
    nfe_full: int
    nfe_partial: int
    row_nfe_full: np.ndarray
    row_nfe_partial: np.ndarray
    tokens_processed: int
    commit_step: np.ndarray
    generated_tokens: list[int]
    prompt_bucket: int
    batch_bucket: int
    compiled: bool
    compile_time: float
    decode_time: float
    hit_step_cap: bool
    call_shapes: tuple[CallShape, ...] = ()
    shape_calls: np.ndarray | None = None
    row_shape_calls: np.ndarray | None = None
    row_shape_keys: np.ndarray | None = None

    def calls_by_shape(self) -> list[dict]:
        """One dict per call shape the decode made at least once: the shape's fields,
        `calls` (per batch), `row_calls` (calls that served a row, summed over rows)
        and `attended_keys` (key columns attended per served row and call, averaged)."""
        out = []
        for i, shape in enumerate(self.call_shapes):
            calls = int(self.shape_calls[i])
            if not calls:
                continue
            row_calls = int(np.sum(self.row_shape_calls[:, i]))
            keys = int(np.sum(self.row_shape_keys[:, i]))
            out.append({**shape.to_dict(), "calls": calls, "row_calls": row_calls,
                        "attended_keys": keys / row_calls if row_calls else 0.0})
        return out

    @property
    def wall_time(self) -> float:
        """compile_time + decode_time."""
        return self.compile_time + self.decode_time

    def __getitem__(self, key: str):
        if key == "wall_time":
            return self.wall_time
        if key not in {f.name for f in dataclasses.fields(self)}:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default=None):
        try:
            return self[key]
        except KeyError:
            return default

    def keys(self):
        return [f.name for f in dataclasses.fields(self)] + ["wall_time"]

    def to_dict(self) -> dict:
        """JSON-ready: arrays become lists."""
        out = {}
        for k in self.keys():
            v = self[k]
            if k == "call_shapes":
                v = [shape.to_dict() for shape in v]
            out[k] = v.tolist() if hasattr(v, "tolist") else v
        return out
