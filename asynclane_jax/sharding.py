"""Sharding by name: one rules table from logical axis names to mesh axes.

Every parameter carries logical axis names (`models/model.py`: vocab, embed, heads,
kv_heads, mlp); the activations at the layer boundaries, the K/V cache and the decode's
per-row arrays are named here. `RULES` maps each name to axes of a mesh with three
axes:

  data    rows of the batch (replicated weights);
  fsdp    rows of the batch, and the weights' `embed` dimension (gathered per layer);
  tensor  attention heads, the MLP's hidden units and the vocabulary (Megatron-style:
          one all-reduce after attention and one after the MLP per layer), and the
          experts of a mixture-of-experts layer (expert parallelism on the same axis:
          see "Mixture of experts" below).

The table is adapted to a model and a mesh by `rules_for`:
  * attention heads are only ever split whole. When the query heads do not divide by the
    tensor axis (Dream-7B's 28 on 8 chips), attention is replicated across it and only
    the MLP and the vocabulary are split; when the query heads divide but the key/value
    heads do not, the queries are split and K/V replicated. Splitting inside a head
    (what a plain name-to-axis table does to a fused [d, heads * head_dim] kernel) costs
    hundreds of all-to-alls per decode step; measured in
    experiments/results/compile/memory-8b.md;
  * any other dimension the mesh axes do not divide (a 159-token vocabulary on 8 chips)
    is replicated rather than refused.

Mixture of experts (LLaDA2, `models.model.SparseMoE`). The mesh has no separate expert
axis: the logical name `expert` (the leading axis E of the stacked expert kernels
[E, d, m] / [E, m, d]) maps to `tensor`, so a tensor axis of n chips holds E/n whole
experts per chip, and their `mlp` dimension, whose mesh axis the expert axis already
takes, is not split further (each chip holds its experts whole; `embed` still follows
fsdp). The router ([d, E] and the bias [E]) and the shared expert are placed as a
dense layer's (router replicated, shared expert split on `mlp`). The model stores the
expert axis unnamed; `param_shardings` names it (`logical_names`). The fused q/k/v
kernel of LLaDA2's attention ([d, (H + 2K) * h], H query heads then K key then K value
heads) is named `heads` by the model, but cutting its columns on the tensor axis does not
give each chip its own query heads (the slices straddle the q / k / v boundaries), so it
is renamed `qkv_heads`, replicated by default: the projection is computed on every chip
of the tensor axis and the output projection `o_proj` is split by heads as in the dense
models. Put ("expert", None) or ("qkv_heads", "tensor") in a rules table to change
either. The routed experts are computed expert-parallel by `routed_experts` (a
shard_map over the expert axis; the compiler's own partitioning of the ragged dots
gathers the experts whole on a TPU), which `SparseMoE` calls.

`ShardingPlan` binds a mesh and rules; `use(plan)` makes it the plan that
`constrain` applies while a decode is traced (no plan: `constrain` does nothing, and a
single device runs exactly as before).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis name -> mesh axes (a name, a tuple of names, or None: replicated).
Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]
RULES: Rules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", "tensor"),
    ("qkv_heads", None),
    ("length", None),
    ("head_dim", None),
    ("layers", None),
)

# Logical names of the arrays the library shards besides the parameters.
ACTIVATION = ("batch", "length", None)  # [b, Q, d] between layers
CACHE = ("layers", "batch", "length", "kv_heads", "head_dim")  # K/V [L, b, T, K, h]
TOKENS = ("batch", "length")  # canvas [b, T]
ROWS = ("batch",)  # per-row vectors [b]

# Named meshes: every device on one axis.
MESH_PRESETS = {
    "data": "data=-1",
    "fsdp": "fsdp=-1",
    "tensor": "tensor=-1",
}

# How attention heads are placed on a tensor axis that does not divide them.
HEAD_POLICIES = ("whole", "split")


class ShardingError(ValueError):
    """A mesh spec, mesh or rules table that cannot be used."""


def parse_mesh_spec(spec: str, n_devices: int) -> dict[str, int]:
    """Sizes of the three mesh axes from "data=2,tensor=4" (absent axes are 1; one
    axis may be -1: whatever the devices leave) or a preset name (`MESH_PRESETS`).

    Raises:
      ShardingError naming the problem (unknown axis, bad size, wrong device count).
    """
    text = MESH_PRESETS.get(spec.strip(), spec)
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES:
            raise ShardingError(
                f"mesh {spec!r}: {part!r} is not AXIS=SIZE with AXIS one of "
                f"{', '.join(MESH_AXES)} (or a preset: {', '.join(MESH_PRESETS)})")
        if name in sizes:
            raise ShardingError(f"mesh {spec!r}: axis {name} given twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ShardingError(f"mesh {spec!r}: size {value!r} of {name} is not an "
                                "integer") from None
        if sizes[name] == 0 or sizes[name] < -1:
            raise ShardingError(f"mesh {spec!r}: size of {name} must be positive or -1")
    if not sizes:
        raise ShardingError(f"mesh {spec!r} names no axis")
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ShardingError(f"mesh {spec!r}: only one axis may be -1")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if n_devices % fixed:
            raise ShardingError(f"mesh {spec!r}: {n_devices} devices do not divide by "
                                f"{fixed}")
        sizes[free[0]] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ShardingError(
            f"mesh {spec!r} has {math.prod(sizes.values())} devices, but there are "
            f"{n_devices} ({jax.default_backend()}); make the sizes multiply to "
            f"{n_devices}, or use -1 for one axis")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def make_mesh(spec: str | Mesh | None, devices: Sequence | None = None) -> Mesh | None:
    """A mesh with the axes (data, fsdp, tensor), all `AxisType.Auto`.

    Args:
      spec: "data=2,tensor=4", a preset name ("tensor": every device on the tensor
        axis), a Mesh (returned as it is), or None (None).
      devices: the devices to lay out (default: all of jax.devices()); e.g. the devices
        of a TPU topology for ahead-of-time compilation.
    """
    if spec is None or isinstance(spec, Mesh):
        return spec
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh_spec(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    # Auto axes: the compiler propagates shardings from the annotated arrays (Explicit,
    # this JAX's default, rejects the embedding gather from a vocab-sharded table).
    try:
        return jax.make_mesh(shape, MESH_AXES,
                             axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)
    except NotImplementedError as e:
        # A TPU slice's chips form a torus: each mesh axis must be a product of whole
        # physical axes (e.g. tensor=8 does not fit a 4x4 slice's axes of 4 and 4).
        raise ShardingError(
            f"mesh {spec!r} ({','.join(f'{a}={n}' for a, n in sizes.items())}) cannot "
            f"be laid over these {len(devices)} devices' physical layout: each mesh "
            f"axis must be a product of whole physical axes ({str(e).splitlines()[0]})"
        ) from None


def describe(mesh: Mesh) -> str:
    """ "data=2,fsdp=1,tensor=4" for a mesh."""
    return ",".join(f"{k}={v}" for k, v in mesh.shape.items())


def rules_for(cfg, mesh: Mesh, *, rules: Rules = RULES, heads: str = "whole") -> Rules:
    """The rules table adapted to a model's heads on a mesh.

    Args:
      cfg: the ModelConfig (n_heads, n_kv_heads).
      mesh: the mesh.
      rules: the table to adapt (default `RULES`).
      heads: "whole" (default): heads are split only whole (see the module docstring);
        "split": the names are mapped as they are, even when a head is cut across
        devices (kept to measure what it costs).
    """
    if heads not in HEAD_POLICIES:
        raise ShardingError(f"heads={heads!r}: expected one of {HEAD_POLICIES}")
    if heads == "split":
        return tuple(rules)
    table = dict(rules)

    def size(name):
        axes = table.get(name)
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        return math.prod(mesh.shape[a] for a in axes)

    if cfg.n_heads % size("heads"):
        table["heads"] = None
        table["kv_heads"] = None
    elif cfg.n_kv_heads % size("kv_heads"):
        table["kv_heads"] = None
    return tuple(table.items())


def _fit(axes, dim: int, mesh: Mesh, taken: set):
    """The longest prefix of `axes` whose mesh size divides dim (None if none), skipping
    axes of size 1 and mesh axes another dimension of the same array already uses."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    axes = tuple(a for a in axes if a not in taken and mesh.shape[a] > 1)
    while axes and dim % math.prod(mesh.shape[a] for a in axes):
        axes = axes[:-1]
    taken.update(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


EXPERT_KERNELS = ("gate_proj", "up_proj", "down_proj")  # under a SparseMoE's `experts`
EXPERT_SCALES = tuple(f"{k}_scale" for k in EXPERT_KERNELS)  # their int8 scales
LAYER_AXIS = "layers"  # a stacked layer layout's leading name (models.model.LAYER_AXIS)


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                 for k in path)


def logical_names(path, names):
    """The logical names a parameter is placed by: the names it carries, except
      * the stacked expert kernels (`.../experts/{gate,up,down}_proj`, [E, ...] or
        [L, E, ...]) and their int8 scales (`..._scale`), whose unnamed expert axis is
        named `expert`;
      * the fused q/k/v kernel of LLaDA2's attention (`.../attn/qkv_proj/kernel`, and
        its int8 `scale`), whose `heads` is `qkv_heads` (see the module docstring).
    None when the parameter carries no names.
    """
    if names is None:
        return None
    names = tuple(names)
    keys = _path_names(path)
    if len(keys) >= 2 and keys[-2] == "experts" and \
            (keys[-1] in EXPERT_KERNELS or keys[-1] in EXPERT_SCALES):
        i = 1 if names[:1] == (LAYER_AXIS,) else 0
        if i < len(names) and names[i] is None:
            names = names[:i] + ("expert",) + names[i + 1:]
    elif len(keys) >= 3 and keys[-3:-1] == ("attn", "qkv_proj") and \
            keys[-1] in ("kernel", "scale"):
        names = tuple("qkv_heads" if n == "heads" else n for n in names)
    return names


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A mesh and the rules that place arrays on it (hashable: part of compile keys)."""

    mesh: Mesh
    rules: Rules

    @property
    def batch_multiple(self) -> int:
        """Rows of a batch must be a multiple of this for the batch to be split evenly."""
        axes = dict(self.rules).get("batch")
        axes = (axes,) if isinstance(axes, str) else (axes or ())
        return math.prod(self.mesh.shape[a] for a in axes)

    def spec(self, logical: Sequence[str | None], shape: Sequence[int]) -> PartitionSpec:
        """The PartitionSpec for an array of `shape` with these logical axis names."""
        table = dict(self.rules)
        return self._fitted([None if n is None else table.get(n) for n in logical], shape)

    def _fitted(self, mesh_axes, shape) -> PartitionSpec:
        """Mesh axes per dimension, each cut to what divides the dimension."""
        if len(mesh_axes) != len(shape):
            raise ShardingError(f"axes {tuple(mesh_axes)} do not match shape {tuple(shape)}")
        taken: set = set()
        return PartitionSpec(*(_fit(a, dim, self.mesh, taken)
                               for a, dim in zip(mesh_axes, shape)))

    def sharding(self, logical, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical, shape))

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def param_shardings(self, state: nnx.State) -> nnx.State:
        """NamedShardings for a parameter State (abstract or concrete): flax maps the
        logical names each parameter carries through the rules, then any mesh axis
        that does not divide its dimension is dropped."""
        with nnx.logical_axis_rules(self.rules):
            specs = nnx.get_partition_spec(state)
        table = dict(self.rules)

        def one(path, v, spec):  # a parameter without names is replicated
            names = v.get_metadata().get("out_sharding") if hasattr(v, "get_metadata") \
                else None
            renamed = logical_names(path, names)
            if renamed is not None and tuple(renamed) != tuple(names):
                axes = tuple(None if n is None else table.get(n) for n in renamed)
            else:
                axes = tuple(spec.get_value()) or (None,) * len(v.shape)
            return v.replace(NamedSharding(self.mesh, self._fitted(axes, v.shape)))

        return jax.tree_util.tree_map_with_path(
            one, state, specs, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def constrain(self, x, logical):
        return jax.lax.with_sharding_constraint(x, self.sharding(logical, x.shape))

    def expert_axes(self, n_experts: int) -> tuple[str, ...]:
        """The mesh axes that split n experts (the `expert` rule, cut to what divides
        n; () when the experts are not split)."""
        axes = self.spec(("expert",), (n_experts,))[0]
        return (axes,) if isinstance(axes, str) else tuple(axes or ())


def plan_for(cfg, mesh: str | Mesh, *, rules: Rules | None = None,
             heads: str = "whole") -> ShardingPlan:
    """The ShardingPlan of a model config on a mesh (a Mesh or a mesh spec string).
    Given rules are used as they are; otherwise `RULES` adapted by `rules_for`."""
    mesh = make_mesh(mesh)
    return ShardingPlan(mesh, tuple(rules) if rules is not None else
                        rules_for(cfg, mesh, heads=heads))


def mesh_of(model) -> Mesh | None:
    """The mesh a model's parameters are placed on, when they are on more than one
    device through a NamedSharding (None otherwise)."""
    return mesh_of_state(nnx.state(model, nnx.Param))


def mesh_of_state(state: nnx.State) -> Mesh | None:
    """`mesh_of` for a model's state (`nnx.split`'s, or its parameters'): the mesh of its
    first parameter."""
    leaves = jax.tree.leaves(nnx.filter_state(state, nnx.Param))
    s = getattr(leaves[0], "sharding", None) if leaves else None
    return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


def param_shardings(cfg, state: nnx.State, mesh=None) -> nnx.State:
    """The sharding of every parameter of a model of config cfg: by the default plan on
    a mesh (a Mesh with this module's axis names, or a spec string), else on the first
    local device.

    Raises:
      ShardingError: a mesh without the axis names, or neither a Mesh nor a spec.
    """
    if mesh is None:
        single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda v: v.replace(single), state,
                            is_leaf=lambda x: isinstance(x, nnx.Variable))
    if isinstance(mesh, Mesh):
        missing = [a for a in MESH_AXES if a not in mesh.axis_names]
        if missing:
            raise ShardingError(
                f"mesh {dict(mesh.shape)}: the parameters are placed by axis names "
                f"{', '.join(MESH_AXES)}; this mesh lacks {', '.join(missing)} "
                "(build it with sharding.make_mesh, or name its axes so)")
    elif not isinstance(mesh, str):
        raise ShardingError(f"mesh {mesh!r}: expected a jax.sharding.Mesh or a spec "
                            "such as 'data=2,tensor=4'")
    return plan_for(cfg, mesh).param_shardings(state)


def shard_model(model, plan: ShardingPlan):
    """Places a model's parameters on the plan's mesh (in place; returns the model)."""
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.device_put(state, plan.param_shardings(state)))
    return model


def place(x, plan: ShardingPlan | None, logical):
    """A host array (the same on every host) on the plan's mesh with these logical
    axes; each process fills only the shards of its own devices. As it is without a
    plan."""
    if plan is None:
        return x
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, plan.sharding(logical, x.shape),
                                        lambda index: x[index])


def decode_shardings(plan: ShardingPlan, params, rows: int, length: int, operands=None):
    """Where each argument of the decode program lives on the plan's mesh: parameters
    by their logical names, the canvas [rows, length] by TOKENS, the per-row vectors by
    ROWS, the PRNG key and the schedule's operands replicated.

    Returns:
      (params, canvas, pad_len, live, rng, operands) shardings.
    """
    replicated = plan.replicated()
    return (plan.param_shardings(params), plan.sharding(TOKENS, (rows, length)),
            plan.sharding(ROWS, (rows,)), plan.sharding(ROWS, (rows,)), replicated,
            jax.tree.map(lambda _: replicated, operands))


def place_decode_arguments(plan: ShardingPlan | None, params, canvas, pad_len, live, rng,
                           operands=None) -> tuple:
    """The decode program's arguments (host arrays, the same on every host) placed where
    `decode_shardings` says; each process fills only its own devices' shards, and
    parameters already on their shardings are not copied. Without a plan: on the default
    device."""
    if plan is None:
        return (params, jnp.asarray(canvas), jnp.asarray(pad_len), jnp.asarray(live), rng,
                jax.tree.map(jnp.asarray, operands))
    rows, length = np.shape(canvas)
    where = decode_shardings(plan, params, rows, length, operands)
    if any(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding != s, params, where[0]))):
        params = jax.device_put(params, where[0])

    def put(x, target):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, target, lambda index: x[index])

    key = jax.random.wrap_key_data(put(jax.random.key_data(rng), where[4]),
                                   impl=jax.random.key_impl(rng))
    return (params, put(canvas, where[1]), put(pad_len, where[2]), put(live, where[3]), key,
            jax.tree.map(put, operands, where[5]))


def to_host(tree):
    """Every array of tree (PRNG keys aside) as a numpy array of its global value;
    arrays spread over several hosts' devices are gathered from all of them (every
    process must call it)."""
    def one(x):
        if not isinstance(x, jax.Array) or jax.dtypes.issubdtype(x.dtype,
                                                                  jax.dtypes.prng_key):
            return x
        if not x.is_fully_addressable:
            from jax.experimental import multihost_utils

            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(x)

    return jax.tree.map(one, tree)


_ACTIVE: list[ShardingPlan] = []


@contextlib.contextmanager
def use(plan: ShardingPlan | None) -> Iterator[None]:
    """Makes `plan` the one `constrain` applies while tracing (None: no constraints)."""
    _ACTIVE.append(plan)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> ShardingPlan | None:
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x, logical):
    """x constrained to the active plan's sharding for these logical axes (x itself
    when no plan is active)."""
    plan = active()
    return x if plan is None else plan.constrain(x, logical)


def routed_experts(x, experts, weights, gate, up, down, dtype, scales=None):
    """`models.moe.routed_experts` (same arguments, same result), expert-parallel when a
    plan is active (`use`) whose `expert` rule splits the experts: each chip computes
    only the (token, expert) pairs of the experts it holds, as one grouped matmul
    (`jax.lax.ragged_dot`) per projection over those pairs sorted by expert, mixes them by
    their routing weights, and the chips' partial sums are added by one all-reduce of
    [N, d] (a `jax.shard_map`, manual over the expert axes only; the other mesh axes stay
    with the compiler). The tokens, the choices and the weights are replicated over the
    expert axes, as the activations between layers are over `tensor`. int8 kernels
    (`scales` given: [E, 1, out] each) are split with their scales, each chip applying
    its own experts' scales to its output rows (`moe.grouped_matmul`).

    Why: under the compiler's own partitioning, the TPU compiler gathers every stacked
    expert kernel whole onto every chip for its ragged dots (libtpu 0.0.42.1; see
    tests/commands/test_aot_llada2.py), which undoes the split. Without an active plan, or
    with experts that are not split, this is `moe.routed_experts` itself.
    """
    from asynclane_jax.models import moe

    plan = active()
    axes = () if plan is None else plan.expert_axes(gate.shape[0])
    if not axes:
        return moe.routed_experts(x, experts, weights, gate, up, down, dtype, scales=scales)
    spread = PartitionSpec(axes if len(axes) > 1 else axes[0])
    quantized = scales is not None

    def local(x, experts, weights, ids, gate, up, down, *local_scales):
        n, k = experts.shape
        held = gate.shape[0]  # this chip's experts: first .. first + held - 1
        # Its first expert's id, from the ids split as the kernels are (not
        # `axis_index`: the TPU compiler refuses the partition id it lowers to when
        # other mesh axes stay with the compiler, e.g. data=2,tensor=4 at 20 layers).
        first = ids[0]
        flat = experts.reshape(-1) - first
        mine = (flat >= 0) & (flat < held)
        key = jnp.where(mine, flat, held)  # other chips' pairs sort last, in no group
        order = jnp.argsort(key, stable=True)
        rows = jnp.take(x.astype(dtype), order // k, axis=0)
        sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
        s_gate, s_up, s_down = local_scales if quantized else (None, None, None)
        # Each row's expert (rows past the groups, zero, take the last one's scale).
        row_groups = jnp.minimum(jnp.take(key, order), held - 1) if quantized else None

        def grouped(lhs, rhs, scale):  # rows past the groups come out zero
            return moe.grouped_matmul(lhs, rhs, sizes, dtype, scale, row_groups)

        hidden = jax.nn.silu(grouped(rows, gate, s_gate)) * grouped(rows, up, s_up)
        out = grouped(hidden, down, s_down)
        out = jnp.zeros_like(out).at[order].set(out)
        w = jnp.where(mine.reshape(n, k), weights, 0.0)
        mixed = jnp.sum(out.reshape(n, k, -1).astype(jnp.float32) * w[..., None], axis=1)
        return jax.lax.psum(mixed, axes)

    extra = tuple(scales) if quantized else ()
    fn = jax.shard_map(local, mesh=plan.mesh, axis_names=frozenset(axes),
                       in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), spread,
                                 spread, spread, spread) + (spread,) * len(extra),
                       out_specs=PartitionSpec())
    ids = jnp.arange(gate.shape[0], dtype=jnp.int32)
    return fn(x, experts, weights, ids, gate, up, down, *extra).astype(dtype)


__all__ = ["ACTIVATION", "CACHE", "EXPERT_KERNELS", "HEAD_POLICIES", "MESH_AXES",
           "MESH_PRESETS", "ROWS", "RULES", "TOKENS", "ShardingError", "ShardingPlan",
           "active", "constrain", "describe", "logical_names", "make_mesh", "mesh_of",
           "parse_mesh_spec", "place", "plan_for", "routed_experts", "rules_for",
           "shard_model", "to_host", "use"]
