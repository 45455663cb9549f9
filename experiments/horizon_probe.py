"""What a visible horizon changes in a model's first prediction on long answers.

A decode with a visible horizon shows the model only the prompt and the first
block_length + horizon generated positions at first. This probe asks what the model
believes about the answer from a fully masked canvas under different views, one
forward each, no sampler involved. Per view, on the first --n held-out problems of the
model's long families (walk / table / walk-down / table-down):
  first label: whether the argmax at the first response position is the reference's
    first token (for v4 the line count: the first label is the header's (N));
  eos at: where the model puts end-of-text first with probability > 0.5 (the answer
    length it expects), beside the reference answer length.

Views:
  full         the whole canvas of --gen-length masks (what a decode without a horizon
               sees first);
  visible V    only the first V masks (block_length + horizon: 128 for AsyncLane's
               defaults);
  visible V + end K  the first V masks and the last K columns of the canvas (their
               true positions), so the canvas end is in view;
  eos cut + M  the first (eos at of the full view) + M masks: a horizon set from the
               model's own length estimate;
  visible V + every k  the first V masks and every k-th column of the rest of the
               canvas (true positions); "+ bias" adds log k to the attention logits of
               those tail keys, as if each stood for the k masks around it (the probe's
               own attention, patched in for those views: `_biased_attention`).

Usage: python experiments/horizon_probe.py --model tiny-llada-v4 [--n 40]
       [--gen-length 512] [--visible 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys

import numpy as np

RESULTS = pathlib.Path(__file__).parent / "results"
STRIDES = (4, 16)


@contextlib.contextmanager
def _biased_attention(key_bias):
    """While active (key_bias a [T] array), the model's attention is a plain softmax
    attention with key_bias added to every query's logits; None: the model's own."""
    from asynclane_jax.models import model as model_module

    if key_bias is None:
        yield
        return
    import jax
    import jax.numpy as jnp

    own = model_module.attention

    def attention(q, k, v, *, key_mask=None, q_block=None, k_block=None,
                  implementation=None):
        del implementation
        if q_block is not None:
            raise NotImplementedError("the probe's attention is bidirectional")
        group = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
        s = s / np.sqrt(q.shape[-1]) + key_bias[None, None, None, :]
        if key_mask is not None:
            s = jnp.where(key_mask[:, None, None, :], s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v.astype(jnp.float32)).astype(q.dtype)

    model_module.attention = attention
    try:
        yield
    finally:
        model_module.attention = own


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llada-v4")
    ap.add_argument("--n", type=int, default=40, help="long-family problems probed")
    ap.add_argument("--gen-length", type=int, default=512)
    ap.add_argument("--visible", type=int, default=128,
                    help="the horizon's first view: block_length + horizon")
    ap.add_argument("--out", default=None,
                    help="default: experiments/results/horizon_probe_<model>.json")
    args = ap.parse_args(argv)
    if args.n < 1 or not 0 < args.visible < args.gen_length:
        ap.error("--n must be >= 1 and 0 < --visible < --gen-length")

    import jax
    import jax.numpy as jnp

    import asynclane_jax as aj
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed import tokenizer as tok

    model = aj.load(args.model)[0]
    task_set = tasks.model_task_set(args.model)
    long = [f for f in tasks.families_of(task_set) if f in tasks.LINE_FAMILIES]
    if not long:
        sys.exit(f"{args.model}: its task set {task_set} has no long family")
    pool = tasks.heldout(tasks.HELDOUT_POOL, task_set)
    problems = [p for p in pool if p.family in long][:args.n]
    special = tok.special_ids()
    mask, eos = special["mask_token_id"], special["eos_token_id"]
    vocab = tok.vocabulary()
    G, V = args.gen_length, args.visible

    def forward(prompt, n_masks, tail=0, stride=0, bias=False):
        """Probabilities at the response positions of prompt + n_masks masks (+ the
        canvas's last `tail` columns, or every `stride`-th column after the first
        n_masks, at their true positions)."""
        P = len(prompt)
        extra = (list(range(P + n_masks, P + G, stride)) if stride
                 else list(range(P + G - tail, P + G)))
        positions = list(range(P + n_masks)) + extra
        tokens = prompt + [mask] * (n_masks + len(extra))
        key_bias = None
        if bias:
            key_bias = jnp.asarray([0.0] * (P + n_masks) + [np.log(stride)] * len(extra))
        with _biased_attention(key_bias):
            logits = model(jnp.asarray([tokens]), positions=jnp.asarray([positions]))
        return np.asarray(jax.nn.softmax(logits[0, P:], axis=-1))

    def eos_at(probs):
        hit = probs[:, eos] > 0.5
        return int(np.argmax(hit)) if hit.any() else int(probs.shape[0])

    views = ["full", f"visible {V}"] + [f"visible {V} + end {k}" for k in (1, 8, 32)] + [
        f"eos cut + {m}" for m in (32, 96)] + [
        f"visible {V} + every {k}{b}" for k in STRIDES for b in ("", " + bias")]
    records = []
    for p in problems:
        prompt = tok.prompt_ids(p.prompt)
        want = p.response.split(" ")[0]
        full = forward(prompt, G)
        end = eos_at(full)
        row = {"family": p.family, "answer_tokens": tasks.answer_tokens(p), "want": want}
        outs = {"full": full, f"visible {V}": forward(prompt, V)}
        for k in (1, 8, 32):
            outs[f"visible {V} + end {k}"] = forward(prompt, V, tail=k)
        for m in (32, 96):
            outs[f"eos cut + {m}"] = forward(prompt, min(G, end + m))
        for k in STRIDES:
            outs[f"visible {V} + every {k}"] = forward(prompt, V, stride=k)
            outs[f"visible {V} + every {k} + bias"] = forward(prompt, V, stride=k, bias=True)
        # eos at: over the contiguous masks only (a view's end columns are not counted)
        row["views"] = {name: {"first": vocab[int(o[0].argmax())],
                               "eos_at": eos_at(o[:V] if "+ end" in name or "every" in name
                                                else o)}
                        for name, o in outs.items()}
        records.append(row)

    summary = {}
    print(f"{args.model} ({task_set}), {len(problems)} long-family problems, gen {G}; "
          f"reference answer tokens: mean {np.mean([r['answer_tokens'] for r in records]):.0f}")
    print(f"{'view':<30} {'first label right':>18} {'eos at (mean)':>14}")
    for name in views:
        right = sum(r["views"][name]["first"] == r["want"] for r in records)
        mean_eos = float(np.mean([r["views"][name]["eos_at"] for r in records]))
        summary[name] = {"first_label_right": right, "n": len(records),
                         "mean_eos_at": mean_eos}
        print(f"{name:<30} {right:>11} of {len(records):<4} {mean_eos:>14.1f}")
    out = pathlib.Path(args.out) if args.out else RESULTS / f"horizon_probe_{args.model}.json"
    out.write_text(json.dumps({"meta": {"model": args.model, "task_set": task_set,
                                        "gen_length": G, "visible": V,
                                        "command": "python experiments/horizon_probe.py "
                                        + " ".join(argv if argv is not None else sys.argv[1:])},
                               "summary": summary, "problems": records}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
