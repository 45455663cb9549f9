"""Peak memory of `checkpoints_convert` on a generated LLaDA-shaped bfloat16 checkpoint.

Writes a sharded safetensors snapshot of about 1.2 GB (random bfloat16 weights, the
real LLaDA tensor names and config schema, written tensor by tensor so the generator
itself stays small), converts it in a fresh subprocess, and reports that process's
peak resident set size next to the output size. The claim under test: peak is about
the output size plus one tensor (plus the interpreter / JAX / orbax baseline), never
twice the model.

Usage: python experiments/convert_memory.py [--workdir DIR] [--layers N] [--keep]
Writes experiments/results/checkpoint/convert_memory.md.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import platform
import shutil
import struct
import subprocess
import sys
import tempfile
import textwrap

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results" / "checkpoint" / "convert_memory.md"


def llada_config(layers: int, *, d_model: int = 1024, n_heads: int = 8,
                 mlp_hidden_size: int = 4096, vocab: int = 126464) -> dict:
    """A LLaDA config.json (OLMo schema); the defaults are this script's small widths,
    LLaDA-8B's are d_model 4096, 32 heads, mlp_hidden_size 12288."""
    return {
        "model_type": "llada", "architectures": ["LLaDAModelLM"],
        "auto_map": {"AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "d_model": d_model, "n_layers": layers, "n_heads": n_heads, "n_kv_heads": n_heads,
        "mlp_hidden_size": mlp_hidden_size, "embedding_size": vocab, "vocab_size": vocab,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "include_qkv_bias": False,
        "weight_tying": False, "mask_token_id": 126336, "eos_token_id": 126081,
        "pad_token_id": 126081, "max_sequence_length": 4096, "activation_type": "silu",
        "block_type": "llama", "layer_norm_type": "rms", "alibi": False,
        "include_bias": False, "rope": True, "torch_dtype": "bfloat16",
    }


def dream_config(layers: int) -> dict:
    """A Dream config.json (Qwen2 schema) at Dream-v0-7B's widths and vocabulary."""
    return {
        "model_type": "Dream", "architectures": ["DreamModel"],
        "auto_map": {"AutoModel": "modeling_dream.DreamModel"},
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": layers,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "max_position_embeddings": 131072, "max_window_layers": layers,
        "bos_token_id": 151643, "eos_token_id": 151643, "pad_token_id": 151643,
        "mask_token_id": 151666, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "use_sliding_window": False,
        "sliding_window": None, "rope_scaling": None, "torch_dtype": "bfloat16",
    }


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> torch shape, in the order the published checkpoints store them
    (embedding first, output head last)."""
    if c["model_type"] == "llada":
        d, m, v = c["d_model"], c["mlp_hidden_size"], c["embedding_size"]
        out = {"model.transformer.wte.weight": (v, d)}
        for i in range(c["n_layers"]):
            b = f"model.transformer.blocks.{i}."
            out.update({b + "attn_norm.weight": (d,), b + "q_proj.weight": (d, d),
                        b + "k_proj.weight": (d, d), b + "v_proj.weight": (d, d),
                        b + "attn_out.weight": (d, d), b + "ff_norm.weight": (d,),
                        b + "ff_proj.weight": (m, d), b + "up_proj.weight": (m, d),
                        b + "ff_out.weight": (d, m)})
        out["model.transformer.ln_f.weight"] = (d,)
        out["model.transformer.ff_out.weight"] = (v, d)
        return out
    d, m, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (v, d)}
    for i in range(c["num_hidden_layers"]):
        b = f"model.layers.{i}."
        out.update({b + "input_layernorm.weight": (d,),
                    b + "self_attn.q_proj.weight": (d, d), b + "self_attn.q_proj.bias": (d,),
                    b + "self_attn.k_proj.weight": (kv, d), b + "self_attn.k_proj.bias": (kv,),
                    b + "self_attn.v_proj.weight": (kv, d), b + "self_attn.v_proj.bias": (kv,),
                    b + "self_attn.o_proj.weight": (d, d),
                    b + "post_attention_layernorm.weight": (d,),
                    b + "mlp.gate_proj.weight": (m, d), b + "mlp.up_proj.weight": (m, d),
                    b + "mlp.down_proj.weight": (d, m)})
    out["model.norm.weight"] = (d,)
    out["lm_head.weight"] = (v, d)
    return out


def write_shard(path: pathlib.Path, shapes: dict[str, tuple[int, ...]], rng,
                block: int = 2**24) -> None:
    """A bfloat16 safetensors file written a block of at most `block` values at a time,
    so that the writer never holds more than a few tens of MiB of it."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for shape in shapes.values():
            left = math.prod(shape)
            while left:
                x = rng.standard_normal(min(left, block), dtype=np.float32) * 0.02
                f.write((x.view(np.uint32) >> 16).astype(np.uint16).tobytes())
                left -= x.size


def write_snapshot(folder: pathlib.Path, layers: int | dict,
                   shard_bytes: int = 400 * 2**20) -> int:
    """A sharded bfloat16 safetensors snapshot with an index; returns its tensor bytes.

    Args:
      folder: created; must not exist.
      layers: blocks of this script's small LLaDA shape, or a whole config.json dict
        (`llada_config`, `dream_config`).
      shard_bytes: tensors are grouped in file order into shards of about this size
        (a tensor larger than it gets a shard of its own).
    """
    cfg = llada_config(layers) if isinstance(layers, int) else layers
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes = tensor_shapes(cfg)
    groups, cur, size = [], {}, 0
    for name, shape in shapes.items():
        n = math.prod(shape) * 2
        if cur and size + n > shard_bytes:
            groups.append(cur)
            cur, size = {}, 0
        cur[name] = shape
        size += n
    groups.append(cur)
    rng = np.random.default_rng(0)
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_shard(folder / fname, group, rng)
        weight_map.update({n: fname for n in group})
    total = sum(math.prod(s) * 2 for s in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import jax, orbax.checkpoint, tqdm  # the baseline: everything convert imports
    from checkpoints_convert import convert
    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    base = rss_mb()
    t0 = time.time()
    r = convert.convert(sys.argv[1], sys.argv[2], progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"baseline_mb": base, "peak_mb": peak, "seconds": time.time() - t0,
                      "output_bytes": r.output_bytes, "source_bytes": r.source_bytes,
                      "tensors": r.n_tensors, "params": r.n_params}))
""")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="convert_memory-"))
    src, dst = work / "src", work / "dst"
    try:
        print(f"writing a {args.layers}-layer bfloat16 LLaDA-shaped snapshot to {src} ...")
        total = write_snapshot(src, args.layers)
        print(f"  {total / 2**30:.2f} GiB; converting in a fresh process ...")
        out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)], check=True,
                             capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["largest_tensor_bytes"] = max(math.prod(s) * 2 for s in
                                        tensor_shapes(llada_config(args.layers)).values())
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out_mb = r["output_bytes"] / 2**20
    extra = r["peak_mb"] - r["baseline_mb"]
    lines = [
        "# Peak memory of checkpoints_convert",
        "",
        "Generated by `python experiments/convert_memory.py` "
        f"(--layers {args.layers}); {platform.machine()}, Python "
        f"{platform.python_version()}.",
        "",
        "A LLaDA-shaped snapshot (d_model 1024, vocab 126,464, untied head, "
        f"{args.layers} blocks) of random bfloat16 weights in 400 MiB safetensors shards "
        "with an index, converted to bfloat16 in a fresh process. Peak RSS is the process's "
        "`ru_maxrss`; the baseline is its RSS after importing JAX, orbax and the converter, "
        "before converting.",
        "",
        "| quantity | value |",
        "|---|---|",
        f"| tensors | {r['tensors']} |",
        f"| parameters | {r['params']:,} |",
        f"| source checkpoint (bf16) | {r['source_bytes'] / 2**20:,.0f} MiB |",
        f"| output parameters (bf16) | {out_mb:,.0f} MiB |",
        f"| largest tensor | {r['largest_tensor_bytes'] / 2**20:,.0f} MiB |",
        f"| baseline RSS (imports) | {r['baseline_mb']:,.0f} MiB |",
        f"| peak RSS | {r['peak_mb']:,.0f} MiB |",
        f"| peak - baseline | {extra:,.0f} MiB |",
        f"| (peak - baseline) / output size | {extra / out_mb:.2f} |",
        f"| peak - baseline - output, in largest tensors | "
        f"{(extra - out_mb) / (r['largest_tensor_bytes'] / 2**20):.2f} |",
        f"| peak / output size | {r['peak_mb'] / out_mb:.2f} |",
        f"| conversion time | {r['seconds']:.1f} s |",
        "",
        "Reading: above the import baseline the converter holds the converted parameters "
        "(the output size) plus a 64 MiB block of source rows being transposed into them "
        "(`checkpoints_convert.convert.read_output`) and some fixed overhead; the orbax "
        "write adds nothing because it writes the host arrays in place, uncompressed, one "
        "chunk per array (`asynclane_jax.checkpoint.save_params`). Loading the whole source "
        "before converting, or orbax's default save (which deep-copies host arrays and "
        "compresses in memory), would each add another model-sized copy. The same "
        "measurement at the real widths, LLaDA and Dream, bf16 and float32 output, is in "
        "load_memory.md (`experiments/load_memory.py`).",
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
