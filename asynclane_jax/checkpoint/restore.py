"""Reading a converted folder's arrays exactly as stored: the stored dtype, shape and
layer layout, each array onto the sharding it is asked for. Every read goes through
orbax's public restore (`PyTreeCheckpointHandler`, a partial restore of a few arrays at
a time); what the model wants instead (another dtype, int8, the other layer layout) is
done afterwards by `checkpoint.transform`.

Arrays are read in groups of at most about the largest stored array's bytes (small
arrays together, so a small model is one restore), so the host holds the arrays
already placed plus about one array in flight, never a second copy of the model:

* Every target on one device: the group is restored as host numpy arrays, then each is
  checked against its digest in a background thread (one hash in flight), given to
  the `cast` hook on the host, put on its device (adopted without a copy where the
  backend can), then handed to the per-array transform before the next one.
* Targets on a mesh: the group is restored straight into its shardings (each host reads
  only its devices' shards), with orbax's restore byte limiter sized to the largest
  stored array, so one array is read at a time (by default orbax reads them all at
  once), then given to `cast` and the transform on its devices. With digests, every
  array is first read whole, one group at a time, and checked.

Measurements: experiments/results/checkpoint/load_restore.md.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from asynclane_jax.checkpoint.format import CheckpointError, flat_arrays, nest, str_keys
from asynclane_jax.checkpoint.integrity import array_digest, check_listing, corrupt_message

# Small arrays are restored together up to this many bytes (or the largest array's,
# whichever is more): one orbax restore has a fixed cost, which a model of many small
# arrays would otherwise pay per array.
GROUP_FLOOR = 16 * 2**20

Transform = Callable[[str, jax.Array], Any]


def stored_arrays(params_dir: pathlib.Path) -> dict[str, Any]:
    """orbax's metadata of every stored array (shape, dtype, storage), by name as in
    digests.json ("layers.0.attn.q_proj.kernel")."""
    import orbax.checkpoint as ocp

    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            tree = ckptr.metadata(params_dir.absolute()).item_metadata.tree
    except Exception as e:  # orbax raises several types for bad checkpoints
        raise CheckpointError(f"cannot read parameters in {params_dir}: "
                              f"{str(e)[:300]}") from e
    return flat_arrays(str_keys(tree))


def model_shapes(model) -> dict[str, tuple]:
    """The shape of every parameter of a (possibly abstract) model, by stored name."""
    from flax import nnx

    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return {k: tuple(v.shape) for k, v in flat_arrays(str_keys(state)).items()}


def _shown(name: str) -> str:
    return "".join(f"['{part}']" for part in name.split("."))


def check_shapes(params_dir: pathlib.Path, stored: Mapping[str, Any],
                 shapes: Mapping[str, tuple]) -> None:
    """Every expected array is stored, in the expected shape."""
    missing = sorted(_shown(k) for k in set(shapes) - set(stored))
    wrong = [f"{_shown(k)}: stored {tuple(stored[k].shape)}, model {tuple(s)}"
             for k, s in sorted(shapes.items(), key=lambda kv: _shown(kv[0]))
             if k in stored and tuple(stored[k].shape) != tuple(s)]
    if missing or wrong:
        parts = ([f"missing {', '.join(missing[:8])}"] if missing else []) + wrong[:8]
        raise CheckpointError(f"parameters in {params_dir} do not match the config: "
                              + "; ".join(parts))


def _stored_bytes(meta) -> int:
    """What reading one stored array takes: the stored chunks covering it, whole."""
    shape = tuple(meta.shape)
    chunks = getattr(getattr(meta, "storage", None), "chunk_shape", None) or shape
    n = 1
    for dim, chunk in zip(shape, chunks, strict=True):
        n *= -(-dim // max(chunk, 1)) * max(chunk, 1)
    return n * np.dtype(meta.dtype).itemsize


def _groups(names: Iterable[str], stored: Mapping[str, Any]) -> Iterator[list[str]]:
    """`names` in order, in runs of at most max(largest array, GROUP_FLOOR) bytes."""
    names = list(names)
    if not names:
        return
    budget = max(GROUP_FLOOR, max(_stored_bytes(stored[n]) for n in names))
    group, size = [], 0
    for name in names:
        n = _stored_bytes(stored[name])
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group.append(name)
        size += n
    yield group


def _restore_group(ckptr, params_dir: pathlib.Path, names: list[str],
                   stored: Mapping[str, Any], shardings: Mapping | None) -> dict:
    """One orbax partial restore of `names` as stored: host numpy arrays (shardings
    None) or jax.Arrays in the given shardings."""
    import orbax.checkpoint as ocp

    items, args = {}, {}
    for name in names:
        meta = stored[name]
        items[name] = jax.ShapeDtypeStruct(tuple(meta.shape), meta.dtype)
        args[name] = (ocp.RestoreArgs(restore_type=np.ndarray) if shardings is None else
                      ocp.ArrayRestoreArgs(sharding=shardings[name],
                                           global_shape=tuple(meta.shape)))
    try:
        out = ckptr.restore(params_dir.absolute(), args=ocp.args.PyTreeRestore(
            item=nest(items), restore_args=nest(args), partial_restore=True))
    except Exception as e:  # tensorstore's errors for missing / corrupt data
        shown = names[0] if len(names) == 1 else f"{names[0]} (of {len(names)})"
        raise CheckpointError(f"cannot read parameter {shown} in {params_dir}: "
                              f"{str(e)[:300]}") from e
    return flat_arrays(out)


def _checkpointer(in_flight: int | None = None):
    import orbax.checkpoint as ocp

    kwargs = {} if in_flight is None else {"restore_concurrent_gb": in_flight / 10**9}
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kwargs))


def read_stored(params_dir: pathlib.Path, names: Iterable[str], *,
                stored: Mapping[str, Any] | None = None
                ) -> Iterator[tuple[str, np.ndarray | CheckpointError]]:
    """Each named array whole on the host, as stored, in order, a group at a time.

    An array that cannot be read is given as its CheckpointError (naming it) in its
    place, so a check can go on past it.
    """
    stored = stored_arrays(params_dir) if stored is None else stored
    with _checkpointer() as ckptr:
        for group in _groups(names, stored):
            try:
                arrays = _restore_group(ckptr, params_dir, group, stored, None)
            except CheckpointError as e:
                if len(group) == 1:
                    yield group[0], e
                    continue
                arrays = None
            if arrays is None:  # find which: one at a time
                for name in group:
                    try:
                        one = _restore_group(ckptr, params_dir, [name], stored, None)[name]
                    except CheckpointError as e:
                        one = e
                    yield name, one
                    del one
                continue
            for name in group:
                yield name, arrays.pop(name)


def mismatched_arrays(params_dir: pathlib.Path, digests: Mapping[str, dict], *,
                      first_only: bool = False) -> list[str]:
    """The names of the stored arrays whose bytes do not match their digests (each read
    whole in its stored dtype, about one at a time)."""
    bad = []
    for name, array in read_stored(params_dir, sorted(digests)):
        ok = (not isinstance(array, CheckpointError)
              and array_digest(array) == digests[name]["digest"])
        if not ok:
            bad.append(name)
            if first_only:
                break
    return bad


def restore_stored(params_dir: pathlib.Path, shardings: Mapping[str, Any], *,
                   shapes: Mapping[str, tuple], digests: Mapping[str, dict] | None = None,
                   cast: Transform | None = None,
                   transform: Transform | None = None) -> dict[str, Any]:
    """Restores the arrays named in `shardings`, as stored, each into its sharding.

    Args:
      params_dir: the checkpoint (a converted folder's params/).
      shardings: stored name -> the jax sharding to restore it into.
      shapes: stored name -> the shape the model expects (checked before any read).
      digests: the folder's digests.json entries: each array is checked against its
        entry; None: no check.
      cast: called as cast(name, array) with each array as read (after its digest is
        taken): on one device with the host numpy array before it is placed, on a mesh
        with the placed array; what it returns is placed / kept instead. None: as read.
      transform: called as transform(name, array) with each array once it is on its
        device(s); what it returns takes the array's place. On one device the next array
        is read only then.
    Returns:
      {stored name: the array (or what transform returned)}.
    Raises:
      CheckpointError for a missing or misshapen array, a digests.json that does not
      list the stored arrays, an array that differs from its digest or cannot be read.
    """
    stored = stored_arrays(params_dir)
    check_shapes(params_dir, stored, shapes)
    if digests is not None:
        check_listing(params_dir, digests, stored)
    names = sorted(shardings)
    keep = lambda name, array: array  # noqa: E731
    cast, transform = cast or keep, transform or keep
    if all(isinstance(s, jax.sharding.SingleDeviceSharding) for s in shardings.values()):
        return _restore_on_one_device(params_dir, names, stored, shardings, digests,
                                      cast, transform)
    if digests is not None:  # orbax reads shards; check each array whole first
        bad = mismatched_arrays(params_dir, digests, first_only=True)
        if bad:
            raise CheckpointError(corrupt_message(params_dir, bad))
    in_flight = max(_stored_bytes(stored[n]) for n in names) + 1
    out = {}
    with _checkpointer(in_flight) as ckptr:
        for group in _groups(names, stored):
            arrays = _restore_group(ckptr, params_dir, group, stored, shardings)
            for name in group:
                out[name] = transform(name, cast(name, arrays.pop(name)))
    return out


def _on_cpu(array: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in array.devices())


def _restore_on_one_device(params_dir, names, stored, shardings, digests,
                           cast: Transform, transform: Transform) -> dict[str, Any]:
    """Host reads, each array hashed (one hash in flight: a stored array is kept at
    most until the next has been read), cast on the host and placed on its device
    before the next."""
    pending: list[tuple[str, concurrent.futures.Future]] = []

    def check_pending() -> None:
        while pending:
            name, digest = pending.pop()
            if digest.result() != digests[name]["digest"]:
                raise CheckpointError(corrupt_message(params_dir, [name]))

    out = {}
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load-check") as hasher:
        for name, array in read_stored(params_dir, names, stored=stored):
            if isinstance(array, CheckpointError):
                raise array
            host = cast(name, array)
            cast_on_host = host is not array
            if digests is not None and cast_on_host:  # hash the bytes as stored
                check_pending()
                pending.append((name, hasher.submit(array_digest, array)))
            del array
            placed = jax.device_put(host, shardings[name]).block_until_ready()
            if digests is not None and not cast_on_host:
                check_pending()
                # On the CPU backend the device buffer is host memory: hash that (a view)
                # so the read buffer can go now; elsewhere hash the host copy.
                view = np.asarray(placed) if _on_cpu(placed) else host
                pending.append((name, hasher.submit(array_digest, view)))
                del view
            del host
            out[name] = transform(name, placed)
            del placed  # the stored array, if the transform made another
        if digests is not None:
            check_pending()
    return out
