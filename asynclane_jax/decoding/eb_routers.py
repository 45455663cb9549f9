"""The two small routers of Early-Bird decoding (EB-Decode, arXiv 2609.16450) as the
`eb` schedule runs them: modules, their input features, folding, save and load.
Training (losses, decode traces, optax loops) lives in `asynclane_jax.testbed.routers`.

  LBS (learnable block size): reads the whole generation region of a canvas, one
    position per element, and scores each position: p = sigmoid(O), "this position is
    ready to be decoded now". Per position: the normalised entropy H/log|V| of the
    frozen model's distribution through Linear(1, 64)-GELU-Linear(64, 64)-LayerNorm,
    and its top-1 token through the frozen base embedding and Linear(d_base, 64);
    concatenated, Linear(128, 128) plus learned positions, a 2-layer Transformer
    (d 128, 4 heads, FFN 256), a linear head. A committed position enters with entropy
    0 and its committed token.
  LPS (position-aware sampler): reads the still-masked positions of the current block
    (attention restricted to them) with five features per position (top-1 probability,
    normalised entropy, top-1 minus top-2 probability, the block's masked share, the
    position's relative place in the block) through Linear(5, 32)-LayerNorm-GELU, two
    Transformer blocks (d 32, 4 heads, FFN 64) and a linear head: p_psi, "the top-1
    token now is the token the decode ends with".

Frozen embedding, folded. The LBS router is trained through the frozen base embedding
E [V, d_base] and Linear(d_base, 64); what inference needs is only E @ W + b, a [V, 64]
table. `fold_lbs` stores that table instead, so the router weights need no model
parameters at decode time. The `eb` schedule hands the folded arrays to the compiled
program as operands (`Schedule.operands`) and rebuilds the modules around them inside
the trace (`build_module`), so routers of one shape share one program.

Saved beside a model: `<model folder>/routers/early_bird.npz` (the folded weights,
flat keys `lbs/...`, `lps/...`) and `early_bird.json` (the router configs, tau_psi and
how it was chosen, training figures, a digest of the weights).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROUTER_DIR = "routers"
WEIGHTS_FILE = "early_bird.npz"
META_FILE = "early_bird.json"
N_LPS_FEATURES = 5


class RouterError(ValueError):
    """Router weights missing, malformed, or made for another model."""


# ----------------------------------------------------------------------------- modules

@dataclasses.dataclass(frozen=True)
class LBSConfig:
    """Shape of the LBS router.

    Attributes:
      vocab_size: V of the base model.
      d_base: width of the base model's embedding.
      d_feat: width of each of the two per-position feature branches.
      d_model: Transformer width (the concatenated branches are projected to it).
      n_heads, ffn, n_layers: the Transformer's heads, FFN width and depth.
      max_len: learned positions (the longest generation region it reads).
    """

    vocab_size: int
    d_base: int
    d_feat: int = 64
    d_model: int = 128
    n_heads: int = 4
    ffn: int = 256
    n_layers: int = 2
    max_len: int = 512


@dataclasses.dataclass(frozen=True)
class LPSConfig:
    """Shape of the LPS router (attributes as LBSConfig's)."""

    n_features: int = N_LPS_FEATURES
    d_model: int = 32
    n_heads: int = 4
    ffn: int = 64
    n_layers: int = 2


class FrozenEmbedding(nnx.Variable):
    """The base model's embedding inside the LBS router while it trains (never updated)."""


class SelfAttention(nnx.Module):
    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        if d % heads:
            raise RouterError(f"d_model={d} is not a multiple of n_heads={heads}")
        self.heads = heads
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.out = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, key_mask=None):
        b, n, d = x.shape
        h = self.heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, n, 3, h, d // h), 3, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q[:, :, 0], k[:, :, 0]) / math.sqrt(d // h)
        if key_mask is not None:
            # A finite fill: a row with no valid key attends uniformly instead of NaN.
            s = jnp.where(key_mask[:, None, None, :], s, -1e9)
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v[:, :, 0])
        return self.out(o.reshape(b, n, d))


class TransformerBlock(nnx.Module):
    """Pre-LayerNorm block: x + attn(LN x), then x + FFN(LN x) with a GELU."""

    def __init__(self, d: int, heads: int, ffn: int, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = SelfAttention(d, heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, ffn, rngs=rngs)
        self.down = nnx.Linear(ffn, d, rngs=rngs)

    def __call__(self, x, key_mask=None):
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class LBSRouter(nnx.Module):
    """Learnable block size router: [b, n] entropy and top-1 ids -> [b, n] logits O.

    Built with `embedding` (the base model's [V, d_base] table, frozen) for training, or
    without it for inference, where `tok_table` [V, d_feat] holds E @ W + b (fold_lbs).
    """

    def __init__(self, cfg: LBSConfig, *, embedding=None, rngs: nnx.Rngs):
        self.cfg = cfg
        f, d = cfg.d_feat, cfg.d_model
        self.ent_in = nnx.Linear(1, f, rngs=rngs)
        self.ent_out = nnx.Linear(f, f, rngs=rngs)
        self.ent_norm = nnx.LayerNorm(f, rngs=rngs)
        if embedding is not None:
            embedding = jnp.asarray(embedding, jnp.float32)
            if embedding.shape != (cfg.vocab_size, cfg.d_base):
                raise RouterError(f"embedding {embedding.shape} does not match "
                                  f"(vocab_size, d_base)=({cfg.vocab_size}, {cfg.d_base})")
            self.embedding = FrozenEmbedding(embedding)
            self.tok_proj = nnx.Linear(cfg.d_base, f, rngs=rngs)
        else:
            self.tok_table = nnx.Param(jnp.zeros((cfg.vocab_size, f), jnp.float32))
        self.mix = nnx.Linear(2 * f, d, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, d)))
        self.blocks = nnx.List([TransformerBlock(d, cfg.n_heads, cfg.ffn, rngs=rngs)
                                for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def token_features(self, top1):
        if hasattr(self, "tok_table"):
            return jnp.take(self.tok_table[...], top1, axis=0)
        return self.tok_proj(jnp.take(self.embedding[...], top1, axis=0))

    def __call__(self, entropy, top1):
        """entropy [b, n] in [0, 1], top1 [b, n] int -> logits O [b, n]."""
        n = entropy.shape[-1]
        if n > self.cfg.max_len:
            raise RouterError(f"LBS router reads at most {self.cfg.max_len} positions, got {n}")
        e = self.ent_norm(self.ent_out(jax.nn.gelu(self.ent_in(entropy[..., None]))))
        x = self.mix(jnp.concatenate([e, self.token_features(top1)], axis=-1))
        x = x + self.pos[...][:n]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))[..., 0]


class LPSRouter(nnx.Module):
    """Position-aware sampler: [b, n, 5] features, [b, n] key mask -> [b, n] logits."""

    def __init__(self, cfg: LPSConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d = cfg.d_model
        self.inp = nnx.Linear(cfg.n_features, d, rngs=rngs)
        self.inp_norm = nnx.LayerNorm(d, rngs=rngs)
        self.blocks = nnx.List([TransformerBlock(d, cfg.n_heads, cfg.ffn, rngs=rngs)
                                for _ in range(cfg.n_layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, features, key_mask):
        x = jax.nn.gelu(self.inp_norm(self.inp(features)))
        for block in self.blocks:
            x = block(x, key_mask)
        return self.head(self.norm(x))[..., 0]


# ----------------------------------------------------------------------------- features

def normalised_entropy(logits):
    """H(softmax(logits)) / log V; [..., V] -> [...] in [0, 1]."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    h = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return h / math.log(logits.shape[-1])


def lbs_inputs(logits, tokens, mask_id: int):
    """The LBS router's inputs over a generation region.

    Args:
      logits: [b, n, V] the call's logits predicting each position.
      tokens: [b, n] the canvas there.
      mask_id: the mask token.
    Returns:
      (entropy [b, n], top1 [b, n] int32): a committed position enters with entropy 0
      and its own token.
    """
    masked = tokens == mask_id
    ent = jnp.where(masked, normalised_entropy(logits), 0.0)
    top1 = jnp.where(masked, jnp.argmax(logits, -1), tokens).astype(jnp.int32)
    return ent, top1


def lps_features(logits, block_masked, size, index):
    """The LPS router's five features per position.

    Args:
      logits: [b, n, V].
      block_masked: [b, n] bool, the current block's still-masked positions.
      size: [b] positions in the block when it was chosen.
      index: [b, n] each block member's index in the block (by position).
    Returns:
      [b, n, 5] float32: top-1 probability, normalised entropy, top-1 minus top-2
      probability, the block's masked share, relative place in the block.
    """
    probs = jax.nn.softmax(logits, axis=-1)
    # Two maxima rather than lax.top_k: they fuse with the rest; top_k does not and is
    # several times slower on CPU.
    p1 = jnp.max(probs, axis=-1)
    top = jnp.arange(logits.shape[-1]) == jnp.argmax(logits, axis=-1)[..., None]
    p2 = jnp.max(jnp.where(top, -1.0, probs), axis=-1)
    size = jnp.maximum(size, 1).astype(jnp.float32)[:, None]
    ratio = jnp.sum(block_masked, axis=-1, keepdims=True) / size
    feats = [p1, normalised_entropy(logits), p1 - p2,
             jnp.broadcast_to(ratio, block_masked.shape), index / size]
    return jnp.stack(feats, axis=-1).astype(jnp.float32)


# ----------------------------------------------------------------------------- save / load

def _path_key(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def flat_params(module) -> dict[str, np.ndarray]:
    """A module's Params as {"a/b/kernel": numpy array}."""
    pure = nnx.to_pure_dict(nnx.state(module, nnx.Param))
    return {_path_key(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(pure)[0]}


def fold_lbs(router: LBSRouter) -> dict[str, np.ndarray]:
    """The router's Params with the frozen embedding and Linear(d_base, d_feat) replaced
    by their product, the [V, d_feat] table inference reads."""
    flat = flat_params(router)
    if "tok_table" in flat:
        return flat
    table = (np.asarray(router.embedding[...]) @ flat.pop("tok_proj/kernel")
             + flat.pop("tok_proj/bias"))
    return dict(flat, tok_table=table.astype(np.float32))


def build_module(cls, cfg, flat: dict):
    """A module of class cls (LBSRouter folded, or LPSRouter) holding the flat arrays
    (numpy arrays, or traced operands inside a compiled program)."""
    abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))
    missing = [_path_key(p) for p, _ in leaves if _path_key(p) not in flat]
    if missing:
        raise RouterError(f"router weights lack {missing}")
    values = []
    for p, leaf in leaves:
        v = flat[_path_key(p)]
        if tuple(v.shape) != tuple(leaf.shape):
            raise RouterError(f"router weight {_path_key(p)}: shape {v.shape}, expected "
                              f"{tuple(leaf.shape)}")
        values.append(jnp.asarray(v))
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, values))
    return nnx.merge(graphdef, state)


class RouterWeights:
    """Router weights as the `eb` schedule holds them: numpy arrays (the LBS folded),
    their configs and metadata, named by a digest of the bytes. Either router may be
    absent (a trace round that runs only the LBS)."""

    def __init__(self, lbs_config: LBSConfig | None, lbs: dict | None,
                 lps_config: LPSConfig | None, lps: dict | None, meta: dict | None = None):
        self.lbs_config, self.lbs = lbs_config, lbs
        self.lps_config, self.lps = lps_config, lps
        self.meta = dict(meta or {})
        h = hashlib.sha256()
        for tag, cfg, arrays in (("lbs", lbs_config, lbs), ("lps", lps_config, lps)):
            h.update(json.dumps([tag, dataclasses.asdict(cfg) if cfg else None]).encode())
            for k in sorted(arrays or {}):
                h.update(k.encode())
                h.update(np.ascontiguousarray(arrays[k], np.float32).tobytes())
        self.digest = h.hexdigest()[:16]

    @classmethod
    def from_modules(cls, lbs: LBSRouter | None = None, lps: LPSRouter | None = None,
                     meta: dict | None = None) -> RouterWeights:
        return cls(lbs.cfg if lbs is not None else None,
                   fold_lbs(lbs) if lbs is not None else None,
                   lps.cfg if lps is not None else None,
                   flat_params(lps) if lps is not None else None, meta)

    def lbs_module(self) -> LBSRouter:
        if self.lbs is None:
            raise RouterError("these router weights have no LBS router")
        return build_module(LBSRouter, self.lbs_config, self.lbs)

    def lps_module(self) -> LPSRouter:
        if self.lps is None:
            raise RouterError("these router weights have no LPS router")
        return build_module(LPSRouter, self.lps_config, self.lps)

    def __hash__(self):
        return hash(self.digest)

    def __eq__(self, other):
        return isinstance(other, RouterWeights) and other.digest == self.digest

    def __repr__(self):
        return f"RouterWeights({self.digest})"


def router_dir(model_folder) -> pathlib.Path:
    return pathlib.Path(model_folder) / ROUTER_DIR


def save_routers(model_folder, weights: RouterWeights) -> pathlib.Path:
    """Writes weights beside a model: <folder>/routers/early_bird.{npz,json}."""
    if weights.lbs is None or weights.lps is None:
        raise RouterError("save both routers")
    out = router_dir(model_folder)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {f"lbs/{k}": v for k, v in weights.lbs.items()}
    arrays.update({f"lps/{k}": v for k, v in weights.lps.items()})
    np.savez(out / WEIGHTS_FILE, **arrays)
    meta = dict(weights.meta, digest=weights.digest,
                lbs_config=dataclasses.asdict(weights.lbs_config),
                lps_config=dataclasses.asdict(weights.lps_config))
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out


def has_routers(folder) -> bool:
    """Whether folder (a model folder or its routers folder) holds router weights."""
    folder = pathlib.Path(folder)
    return ((folder / WEIGHTS_FILE).is_file()
            or (folder / ROUTER_DIR / WEIGHTS_FILE).is_file())


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime: float) -> RouterWeights:
    del mtime  # part of the cache key: a rewritten file is read again
    folder = pathlib.Path(path)
    try:
        meta = json.loads((folder / META_FILE).read_text())
        with np.load(folder / WEIGHTS_FILE) as data:
            arrays = {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError) as e:
        raise RouterError(f"{folder}: cannot read router weights ({e})") from None
    lbs = {k[4:]: v for k, v in arrays.items() if k.startswith("lbs/")}
    lps = {k[4:]: v for k, v in arrays.items() if k.startswith("lps/")}
    bad = [k for k, v in arrays.items()
           if not np.issubdtype(v.dtype, np.number) or not np.all(np.isfinite(v))]
    if bad:
        raise RouterError(f"{folder / WEIGHTS_FILE}: non-finite or non-numeric router "
                          f"weights ({', '.join(sorted(bad)[:3])})")
    try:
        weights = RouterWeights(LBSConfig(**meta.pop("lbs_config")), lbs,
                                LPSConfig(**meta.pop("lps_config")), lps, meta)
    except (KeyError, TypeError) as e:
        raise RouterError(f"{folder / META_FILE}: not a router description ({e})") from None
    recorded = meta.get("digest")
    if recorded is not None and recorded != weights.digest:
        raise RouterError(f"{folder}: the router weights do not match the digest recorded "
                          f"in {META_FILE} ({weights.digest} != {recorded}): the files were "
                          "changed or mixed up")
    return weights


def load_routers(folder) -> RouterWeights:
    """Reads router weights from a model folder or its routers folder."""
    folder = pathlib.Path(folder).expanduser().absolute()
    if not (folder / WEIGHTS_FILE).is_file():
        folder = folder / ROUTER_DIR
    if not (folder / WEIGHTS_FILE).is_file() or not (folder / META_FILE).is_file():
        raise RouterError(f"no router weights in {folder} (expected {WEIGHTS_FILE} and "
                          f"{META_FILE}; experiments/train_eb.py writes them)")
    return _load(str(folder), (folder / WEIGHTS_FILE).stat().st_mtime)
