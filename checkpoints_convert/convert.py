"""Hugging Face LLaDA / Dream snapshot -> asynclane-jax converted folder.

The conversion is planned before it starts (config parsed, every shard header read,
the whole tensor listing checked against the name table, the LoRA adapter checked
against the base) so that bad input fails fast and writes nothing. It then streams:
tensors are read shard by shard, one at a time, merged with their LoRA pair if any,
transposed and cast into the output dtype, and kept only in that form. A safetensors
tensor is read a block of rows at a time straight into its transposed output, so it
never exists in its source layout; the orbax write adds nothing (see
`checkpoint.save_params`). Peak memory is about the output size plus a block (plus one
tensor for a LoRA-merged or `.bin` source); measured in experiments/results/
load_memory.md. Output goes to a temporary folder beside DST that is renamed into place
at the end, so an interrupted run leaves no DST.

Each output array is also checked for non-finite values and its digest recorded
(`checkpoint.array_digest`, in a background thread while the next tensor is read) into
digests.json, which `load` and `asynclane-jax verify` check the stored arrays against.

SIGINT and SIGTERM stop a conversion and remove its temporary folder: while tensors are
read they act at once; during orbax's write, the final renames and the removal itself
they are held until that step ends (orbax's writer threads would otherwise go on filling
a folder being removed), then act.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pathlib
import queue
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping

import ml_dtypes
import numpy as np

from asynclane_jax import checkpoint
from asynclane_jax.checkpoint import signals_held
from asynclane_jax.models.config import ModelConfig, from_hf_config
from asynclane_jax.models.model import abstract_model, stack_layer_params
from checkpoints_convert import lora as lora_mod
from checkpoints_convert import reader
from checkpoints_convert.names import Assignment, ConvertError, path_str, plan

OUTPUT_DTYPES = ("bfloat16", "float32")
# Parameter dtype name -> numpy dtype of the stored arrays (bfloat16 from ml_dtypes).
NP_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32),
             "float16": np.dtype(np.float16)}


# End-of-turn tokens of the supported chat models: LLaDA-8B-Instruct's Llama-3-style
# "<|eot_id|>" (126348) and Dream-v0-Instruct-7B's Qwen2 "<|im_end|>" (151645). Their
# config.json files do not name them; their tokenizers and chat templates do.
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|im_end|>")


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What a conversion did (for the one-line summary and for tests)."""

    dst: pathlib.Path
    cfg: ModelConfig
    source_kind: str
    n_shards: int
    n_tensors: int
    n_params: int
    source_bytes: int
    output_bytes: int
    lora_tensors: int
    seconds: float
    quantize: str | None = None

    def summary(self) -> str:
        merged = f", {self.lora_tensors} LoRA-merged" if self.lora_tensors else ""
        kernels = f", {self.quantize} kernels" if self.quantize else ""
        return (f"converted {self.cfg.family}: {self.n_tensors} tensors{merged} "
                f"({self.n_params:,} parameters) from {self.n_shards} {self.source_kind} "
                f"shard(s), {self.source_bytes / 2**30:.2f} GiB -> "
                f"{checkpoint.printable(self.dst)} "
                f"({self.cfg.param_dtype}{kernels}, {self.output_bytes / 2**30:.2f} GiB) "
                f"in {self.seconds:.1f} s")


# Rows of a source tensor read at a time when converting from safetensors: the tensor
# is never in memory in its source layout, only this much of it.
BLOCK_BYTES = 64 * 2**20


def to_output(array: np.ndarray, assignment: Assignment, dtype: np.dtype) -> np.ndarray:
    """Source layout -> parameter layout, C-contiguous, in the output dtype (one copy)."""
    if assignment.transform == "transpose":
        array = array.T
    return np.array(array, dtype=dtype, order="C")


def read_output(source: reader.TensorSource, assignment: Assignment, dtype: np.dtype,
                block_bytes: int = BLOCK_BYTES, out: np.ndarray | None = None) -> np.ndarray:
    """One source tensor in parameter layout and the output dtype, filled a block of
    source rows at a time: besides the result, only one block is in memory. With `out`
    (a slice of a stacked output, of the parameter layout's shape and dtype), it is
    filled in place and returned."""
    info = source.info
    if len(info.shape) < 1 or info.shape[0] == 0:
        if out is None:
            return to_output(source.read(), assignment, dtype)
        out[...] = to_output(source.read(), assignment, dtype)
        return out
    transpose = assignment.transform == "transpose"
    if out is None:
        out = np.empty(info.shape[::-1] if transpose else info.shape, dtype)
    rows = info.shape[0]
    step = max(1, block_bytes // max(1, info.nbytes // rows))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        block = source.rows(start, stop)
        if transpose:
            out[:, start:stop] = block.T
        else:
            out[start:stop] = block
    return out


def count_nonfinite(array: np.ndarray, block_bytes: int = BLOCK_BYTES) -> int:
    """NaN and infinite values in a floating array, counted a block at a time (no
    array-sized temporary)."""
    try:
        ml_dtypes.finfo(array.dtype)  # numpy's floats and bfloat16
    except ValueError:
        return 0  # integers and booleans are always finite
    flat = array.reshape(-1)
    step = max(1, block_bytes // max(1, array.dtype.itemsize))
    return sum(int(flat[i:i + step].size - np.count_nonzero(np.isfinite(flat[i:i + step])))
               for i in range(0, flat.size, step))


def inspect_output(array: np.ndarray) -> tuple[dict, int]:
    """(its digests.json entry, its count of non-finite values): what the converter
    records and checks of each output array."""
    return checkpoint.digest_entry(array), count_nonfinite(array)


# Seconds after which an interrupt that landed where Python cannot raise it is delivered
# again (sigterm_as_interrupt).
REDELIVER_S = 0.005


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt inside (as SIGINT does), so that a terminated
    conversion still removes its temporary folder. Main thread only; elsewhere a no-op.

    A signal can land while the interpreter runs a garbage-collector callback or a
    `__del__` (JAX registers one), where an exception cannot propagate: Python would
    print it as a traceback and carry on as if no signal had come. Inside, such an
    interrupt is sent again a moment later as SIGTERM (so that a block holding signals,
    `integrity.signals_held`, holds it too), by a thread started on entry, and raised
    wherever the main thread is by then. A signal that lands in the hook that asks for
    it again (where raising would drop it too) is asked for again instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    requests: queue.SimpleQueue = queue.SimpleQueue()  # True: send one; None: stop
    closed = threading.Event()

    def handler(signum, frame):
        f = frame
        while f is not None:
            if f.f_code is unraisable.__code__:  # raised here, it would be dropped
                requests.put(True)
                return
            f = f.f_back
        raise KeyboardInterrupt

    def unraisable(info):
        if info.exc_type is not None and issubclass(info.exc_type, KeyboardInterrupt):
            requests.put(True)
        else:
            previous_hook(info)

    def resend():
        while requests.get() is not None:
            if not closed.wait(REDELIVER_S):
                os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=resend, name="sigterm-again", daemon=True)
    sender.start()
    previous = signal.signal(signal.SIGTERM, handler)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        closed.set()
        requests.put(None)
        sender.join(timeout=1.0)  # no signal of its own arrives after the handler is gone
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGTERM, previous)


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def params_from_tensors(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """In-memory conversion: HF-named numpy arrays -> the model's nested parameter dict.

    Uses the same name table and checks as `convert`; the dict can be loaded with
    `nnx.replace_by_pure_dict` (layer keys are ints).
    """
    assignments = plan(cfg, {n: np.shape(t) for n, t in tensors.items()})
    dtype = NP_DTYPES[cfg.param_dtype]
    params: dict = {}
    stacks: dict = {}
    for name, a in assignments.items():
        out = to_output(np.asarray(tensors[name]), a, dtype)
        if a.index is None:
            _set(params, a.target, out)
        else:  # one expert of a stacked parameter
            if a.target not in stacks:
                stacks[a.target] = np.empty(a.target_shape, dtype)
                _set(params, a.target, stacks[a.target])
            stacks[a.target][a.index] = out
    return params


def end_of_turn_from_tokenizer(folder: pathlib.Path, cfg: ModelConfig) -> int | None:
    """The end-of-turn id a chat snapshot's tokenizer files declare, or None.

    A token counts if it is one of END_OF_TURN_TOKENS, declared as an added token, within
    the vocabulary, and used by a chat template of the snapshot: a base model whose
    tokenizer merely reserves the token (and has no template using it) gets none, as its
    preset does.
    """
    tokens = reader.added_tokens(folder)
    templates = reader.chat_templates(folder)
    for content in END_OF_TURN_TOKENS:
        token_id = tokens.get(content)
        if (token_id is not None and 0 <= token_id < cfg.vocab_size
                and any(content in t for t in templates)):
            return token_id
    return None


def _check_destination(src: pathlib.Path | None, dst: pathlib.Path, force: bool) -> None:
    try:
        _check_destination_paths(src, dst, force)
    except OSError as e:  # a name too long, a parent that is a file, a link loop, ...
        raise ConvertError(f"output {dst}: {e.strerror or e}") from None


def _check_destination_paths(src: pathlib.Path | None, dst: pathlib.Path,
                             force: bool) -> None:
    if dst.is_symlink() and not dst.exists():
        raise ConvertError(f"output {dst} is a symbolic link to {os.readlink(dst)}, which "
                           "does not exist; remove the link or choose another DST")
    for parent in dst.parents:
        if parent.is_symlink() and not parent.exists():
            raise ConvertError(f"output {dst}: {parent} is a symbolic link to "
                               f"{os.readlink(parent)}, which does not exist")
        if parent.exists():
            if not parent.is_dir():
                raise ConvertError(f"output {dst}: {parent} is a file, not a folder")
            break
    if src is not None and (src.resolve() == dst.resolve()
                            or dst.resolve() in src.resolve().parents):
        raise ConvertError(f"output {dst} would overwrite the source {src}; choose another DST")
    if dst.exists() and not force:
        raise ConvertError(f"output {dst} already exists; pass --force to replace it")
    if dst.exists() and not (dst.is_dir() and (dst / checkpoint.CONFIG_FILE).is_file()
                             or dst.is_dir() and not any(dst.iterdir())):
        raise ConvertError(f"output {dst} exists and is not a converted model folder; "
                           "refusing to replace it even with --force")


def prepare(src: str, *, dtype: str | None = None, lora: str | None = None,
            cache_dir: str | None = None):
    """Resolves and checks everything without reading tensor data.

    Returns:
      (snapshot, cfg, assignments, adapter or None).
    Raises:
      ConvertError / ConfigError naming every problem found.
    """
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ConvertError(f"--dtype {dtype}: expected one of {OUTPUT_DTYPES}")
    folder = reader.resolve_source(src, cache_dir=cache_dir)
    snap = reader.open_snapshot(folder)
    out_dtype = dtype or snap.float_dtype()
    if out_dtype not in NP_DTYPES:
        out_dtype = "float32"
    cfg = from_hf_config(snap.hf_config, dtype=out_dtype)
    check_tokenizer_files(snap.folder)
    if cfg.eot_token_id is None:
        # Instruct models end a turn with a token their config.json does not name; without
        # it, generation would run on past the answer where the authors' code stops.
        cfg = cfg.replace(eot_token_id=end_of_turn_from_tokenizer(snap.folder, cfg))
    adapter = lora_mod.load_adapter(lora) if lora else None
    shapes = {n: t.shape for n, t in snap.tensors.items()}
    lora_problems = lora_mod.check_against(adapter, shapes) if adapter else []
    try:
        assignments = plan(cfg, shapes, duplicates=snap.duplicates)
    except ConvertError as e:
        extra = ("; " + "; ".join(lora_problems)) if lora_problems else ""
        raise ConvertError(f"{e}{extra}; nothing was written") from None
    if lora_problems:
        raise ConvertError("the LoRA adapter does not fit the checkpoint: "
                           + "; ".join(lora_problems[:8]) + "; nothing was written")
    return snap, cfg, assignments, adapter


# Tokenizer files that must be JSON objects when present.
_JSON_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json",
                         "added_tokens.json", "generation_config.json", "vocab.json")


def check_tokenizer_files(folder: pathlib.Path) -> None:
    """Refuses tokenizer files a converted folder could not be loaded with: a
    tokenizer.json the tokenizers library cannot parse, JSON files that are not JSON
    objects, a chat template or merges.txt that is not UTF-8 text, a chat template that
    is not valid Jinja.

    Raises:
      ConvertError naming the file.
    """
    for name in _JSON_TOKENIZER_FILES:
        path = folder / name
        if path.is_file() and not isinstance(reader._json_file(path), dict):
            raise ConvertError(f"{path} is not a valid tokenizer file: not a JSON object")
    for name in ("chat_template.jinja", "merges.txt"):
        path = folder / name
        if path.is_file():
            try:
                path.read_text(encoding="utf-8")
            except (OSError, ValueError) as e:
                raise ConvertError(f"{path} is not a valid tokenizer file: {e}") from None
    for template in reader.chat_templates(folder):
        checkpoint.check_chat_template(template, folder)
    path = folder / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        try:
            Tokenizer.from_file(str(path))
        except Exception as e:  # the library's parse errors have no common type
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConvertError(f"{path} is not a valid tokenizer: {first[:160]}; nothing "
                               "was written") from None


def convert(src: str, dst: str | os.PathLike, *, dtype: str | None = None,
            lora: str | None = None, force: bool = False, progress: bool = True,
            cache_dir: str | None = None, block_causal: bool = False,
            scan_layers: bool = False, quantize: str | None = None,
            on_tensor: Callable[[str], None] | None = None) -> ConvertResult:
    """Converts a Hugging Face LLaDA / Dream snapshot into a converted folder.

    Args:
      src: a local snapshot folder, or a hub id present in the local HF cache.
      dst: the output folder; must not exist unless `force`.
      dtype: output parameter dtype ("bfloat16" or "float32"); default: the source
        tensors' dtype.
      lora: a PEFT LoRA adapter folder to merge into the weights.
      block_causal: mark the model as trained block-causal (a D2F student, whose
        adapter and config do not say so), so that `sampler="d2f"` caches its blocks.
      scan_layers: write the stacked layer layout (`ModelConfig.scan_layers`: every
        layer tensor stacked into one [L, ...] array, `layers.<name>`); default the
        unrolled one (`layers.<i>.<name>`). `load` reads either into either.
      quantize: "int8": store every linear layer's kernel (and a LLaDA2 model's stacked
        routed experts, one scale per expert and output channel; its routers stay
        float) as int8 with one float32
        scale per output channel (asynclane_jax.models.quantize, the numbers
        `load(..., quantize="int8")` computes from the float folder), recorded in
        config.json; about half the bytes of bfloat16. None: the float weights.
      force: replace an existing converted folder at `dst`.
      progress: show a tqdm bar (bytes of tensors done / total) on stderr.
      cache_dir: Hugging Face cache to look hub ids up in (default: the usual one).
      on_tensor: called with each source name after it is converted (tests use it to
        interrupt a conversion midway).
    Returns:
      A ConvertResult.
    """
    with sigterm_as_interrupt():
        return _convert(src, dst, dtype=dtype, lora=lora, force=force, progress=progress,
                        cache_dir=cache_dir, block_causal=block_causal,
                        scan_layers=scan_layers, quantize=quantize, on_tensor=on_tensor)


def quantize_kernels(params: dict, digests: dict, mode: str, out_in=(),
                     quantized: frozenset | None = None) -> dict:
    """Every array the int8 model holds as int8 (its `quantize.name_pattern` in
    `quantized`, `quantize.quantized_names` of the quantized abstract model: the linear
    layers' kernels and a mixture-of-experts model's stacked experts, not its routers;
    None: every `kernel`) replaced by its int8 values with its scale beside it
    (`quantize.scale_name`), one array at a time, by the function
    `load(..., quantize="int8")` uses (quantize.quantize_array), transposed for the layers
    named in out_in (`quantize.out_in_layers`); `digests` (dotted name -> entry) updated
    to what is stored."""
    from asynclane_jax.models import quantize as quantize_lib

    def wanted(key, name):
        return key == "kernel" if quantized is None else \
            quantize_lib.name_pattern(name) in quantized

    def walk(tree, prefix):
        for key in list(tree):
            value, name = tree[key], f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, name + ".")
            elif wanted(key, name):
                values, scale = (np.asarray(x) for x in quantize_lib.quantize_array(
                    value, out_in=quantize_lib.layer_of(name) in out_in))
                scale_key = quantize_lib.scale_name(key)
                tree[key], tree[scale_key] = values, scale
                digests[name] = checkpoint.digest_entry(values)
                digests[f"{prefix}{scale_key}"] = checkpoint.digest_entry(scale)

    quantize_lib.check_mode(mode)
    walk(params, "")
    return params


def _convert(src, dst, *, dtype, lora, force, progress, cache_dir, block_causal,
             scan_layers, quantize, on_tensor) -> ConvertResult:
    from asynclane_jax.models import quantize as quantize_lib

    t0 = time.perf_counter()
    quantize = quantize_lib.check_mode(quantize)
    dst = reader.user_path(dst).absolute()
    src_path = reader.user_path(src)
    try:
        src_exists = src_path.exists()
    except OSError:  # resolve_source names the problem
        src_exists = False
    _check_destination(src_path if src_exists else None, dst, force)
    snap, cfg, assignments, adapter = prepare(src, dtype=dtype, lora=lora, cache_dir=cache_dir)
    _check_destination(snap.folder, dst, force)
    out_dtype = NP_DTYPES[cfg.param_dtype]
    total = sum(snap.tensors[n].nbytes for n in assignments)

    from tqdm import tqdm

    tmp = None
    # Hashing and the finiteness check of each output run here while the next is read.
    inspector = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="convert-check")
    try:
        with signals_held():
            try:
                dst.parent.mkdir(parents=True, exist_ok=True)
                tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-",
                                                    dir=dst.parent))
            except OSError as e:
                raise ConvertError(f"cannot create the output beside {dst}: "
                                   f"{e.strerror or e}") from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
        params: dict = {}
        # What each check is of: a source's output, or (key "<target>[*]") a stacked
        # parameter once every expert's slice is in it.
        checks: dict[str, concurrent.futures.Future] = {}
        checked: dict[str, tuple] = {}
        stacks: dict[tuple, list] = {}  # target -> [array, slices still to fill]
        n_params = out_bytes = merged = 0
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="convert",
                  file=sys.stderr, disable=not progress, leave=False) as bar:
            for info, source in snap.iter_sources(assignments):
                a = assignments[info.name]
                into = None
                if a.index is not None:  # one expert's slice of a stacked parameter
                    if a.target not in stacks:
                        stacks[a.target] = [np.empty(a.target_shape, out_dtype), a.n_stacked]
                        _set(params, a.target, stacks[a.target][0])
                    into = stacks[a.target][0][a.index]
                if adapter is not None and info.name in adapter.pairs:
                    out = to_output(adapter.merge(info.name, source.read()), a, out_dtype)
                    if into is not None:  # an expert's slice: into its stacked array
                        into[...] = out
                        out = into
                    merged += 1
                else:
                    out = read_output(source, a, out_dtype, out=into)
                del source
                if out.shape != a.shape:  # plan() checked; guards a reader bug
                    raise ConvertError(f"{info.name} -> {path_str(a.target)}: shape {out.shape}")
                if a.index is None:
                    _set(params, a.target, out)
                    checks[info.name] = inspector.submit(inspect_output, out)
                    checked[info.name] = a.target
                else:
                    stack = stacks[a.target]
                    stack[1] -= 1
                    if not stack[1]:  # every expert is in: check the stacked array
                        key = f"{path_str(a.target)}[*]"
                        checks[key] = inspector.submit(inspect_output, stack[0])
                        checked[key] = a.target
                _refuse_nonfinite({k: f for k, f in checks.items() if f.done()}, adapter)
                n_params += out.size
                out_bytes += out.nbytes
                bar.update(info.nbytes)
                if on_tensor is not None:
                    on_tensor(info.name)
        _refuse_nonfinite(checks, adapter)
        digests = {path_str(checked[n]): f.result()[0] for n, f in checks.items()}
        extra = {"converted_from": {
            "source": str(src), "format": snap.kind, "shards": [p.name for p in snap.shards],
            "tensors": len(assignments), "source_dtype": snap.float_dtype(),
            "lora": adapter.summary() if adapter else None,
            "lora_config": adapter.config if adapter else None}}
        cfg = cfg.replace(block_causal=block_causal, scan_layers=bool(scan_layers))
        if quantize is not None:  # layer by layer, as load(quantize=) does it
            out_in = quantize_lib.out_in_layers(abstract_model(cfg))
            from flax import nnx

            quantized = quantize_lib.quantized_names(nnx.state(quantize_lib.abstract_quantized(
                abstract_model(cfg), quantize)))
            params = quantize_kernels(params, digests, quantize, out_in, quantized)
            extra[checkpoint.QUANTIZATION_KEY] = quantize
            extra[checkpoint.INT8_OUT_IN_KEY] = list(out_in)
            out_bytes = sum(v.nbytes for v in checkpoint.flat_arrays(params).values())
        if scan_layers:  # one stacked array per layer tensor; their digests as stored
            params = stack_layer_params(params, cfg.n_layers, cfg.layer_stacks())
            digests = {k: v for k, v in digests.items() if not k.startswith("layers.")}
            digests.update({k: checkpoint.digest_entry(v) for k, v in
                            checkpoint.flat_arrays({"layers": params["layers"]}).items()})
        checkpoint.write_config(tmp, cfg, snap.hf_config, extra)
        checkpoint.write_digests(tmp, digests)
        with signals_held():  # orbax's writer threads must finish before tmp is removed
            checkpoint.save_params(tmp / checkpoint.PARAMS_DIR, params)
        del params
        copy_tokenizer(snap.folder, tmp, cfg.family)
        # Too late to stop once the rename starts: a signal during it is dropped and the
        # conversion completes.
        with signals_held(raise_after=False):
            _install(tmp, dst)
    except BaseException:
        inspector.shutdown(wait=True, cancel_futures=True)
        checkpoint.remove_tree(tmp)
        raise
    inspector.shutdown(wait=True)
    return ConvertResult(dst, cfg, snap.kind, len(snap.shards), len(assignments), n_params,
                         total, out_bytes, merged, time.perf_counter() - t0, quantize)


def _refuse_nonfinite(checks: Mapping[str, concurrent.futures.Future], adapter) -> None:
    bad = {name: n for name, f in checks.items() if (n := f.result()[1])}
    if bad:
        merged = [n for n in bad if adapter is not None and n in adapter.pairs]
        shown = ", ".join(f"{n} ({k:,})" for n, k in list(bad.items())[:4])
        raise ConvertError(
            f"{len(bad)} tensor(s) hold NaN or infinite values: {shown}"
            + (f"; {len(merged)} of them merged with the LoRA adapter, whose tensors or "
               "alpha may be at fault" if merged else "")
            + "; nothing was written")


def copy_tokenizer(src: pathlib.Path, dst: pathlib.Path, family: str) -> list[str]:
    """Copies the tokenizer files; builds tokenizer.json when a snapshot lacks one.

    Dream snapshots ship a slow Qwen2 tokenizer (vocab.json, merges.txt and a remote-code
    tokenization_dream.py) without tokenizer.json, which is what `asynclane_jax.load`
    reads. transformers' own Qwen2Tokenizer builds the same byte-level BPE from those
    files (plus the added tokens in tokenizer_config.json) without running remote code.
    """
    copied = checkpoint.copy_tokenizer_files(src, dst)
    if ("tokenizer.json" in copied or family != "dream"
            or not ((src / "vocab.json").is_file() and (src / "merges.txt").is_file())):
        return copied
    try:
        from transformers import Qwen2Tokenizer

        tok = Qwen2Tokenizer.from_pretrained(str(src), local_files_only=True)
        declared = json.loads((src / "tokenizer_config.json").read_text()).get(
            "added_tokens_decoder", {}) if (src / "tokenizer_config.json").is_file() else {}
        wrong = [f"{t['content']}={i}" for i, t in declared.items()
                 if tok.convert_tokens_to_ids(t["content"]) != int(i)]
        if wrong:
            raise ValueError(f"added tokens would get other ids than declared: {wrong[:4]}")
        tok.backend_tokenizer.save(str(dst / "tokenizer.json"))
        copied.append("tokenizer.json")
    except Exception as e:  # the weights are still usable; say why there is no tokenizer
        print(f"warning: could not build tokenizer.json from vocab.json + merges.txt "
              f"({type(e).__name__}: {e}); the converted folder has no tokenizer",
              file=sys.stderr)
    return copied


def _install(tmp: pathlib.Path, dst: pathlib.Path) -> None:
    """Renames the finished temporary folder to dst, replacing an old dst last."""
    if not dst.exists():
        os.replace(tmp, dst)
        return
    old = pathlib.Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
    os.replace(dst, old / "x")
    try:
        os.replace(tmp, dst)
    except BaseException:
        os.replace(old / "x", dst)
        raise
    finally:
        checkpoint.remove_tree(old)
