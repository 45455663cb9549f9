"""What the D2F students see in distillation against what they meet when decoding long answers.

Four measurements, for the shipped v4 students and their teachers:

1. Training states (no model): batches drawn exactly as `Distiller` draws them (the
   teacher's task set, family weights and length buckets, bucket policy "fits") and
   masked as `distill.distill_loss` masks them (per row one ratio per block of 32,
   drawn uniformly in [t_eps, 1] and sorted to rise along the response). For every
   block that holds answer tokens: its index, the share of the generated left context
   (response positions before it) that is masked, and the masked answer tokens it
   supervises. Also the answer lengths of the training rows, and the totals over each
   student's recorded step count.
2. Decode states: the d2f sampler (its defaults, and one block in flight) on the first
   long held-out problems (reference answer over 256 tokens), every call recorded. For
   every committed position: its block and the share of the left context still masked
   at that call. The student's cached logits are checked against one block-causal full
   forward of the canvas of every call (the decoder check of
   tests/decoding/test_d2f_cached_logits.py, on the shipped students).
3. Agreement on the decode trajectory: at each position the student commits, whether
   its token is the teacher's argmax on the same canvas (the teacher reads it
   bidirectionally, as in distillation).
4. Agreement on controlled long-answer canvases built from the reference answers: for
   each answer block k, (a) the left context clean (the reference), block k and the
   rest masked, as decoding meets a block past 256 when the blocks before it are done;
   (b) the same with half of block k revealed; (c) the training distribution (the
   whole response masked with sorted rising ratios). At block k's masked positions:
   student argmax = teacher argmax, student = reference, teacher = reference, overall
   and at the line labels.

  python experiments/d2f_contexts.py [--models tiny-llada-v4b-d2f,tiny-dream-v4-d2f]
      [--n-long 16] [--train-batches 4000]

Writes experiments/results/baselines/d2f_contexts.json (the markdown, d2f_contexts.md,
is written by hand from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
import time

import numpy as np

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "baselines"
FAR = 256  # generated positions from here on: where only long answers reach
BLOCK = 32


# --------------------------------------------------------------------------- training

def sorted_ratios(rng: np.random.Generator, rows: int, blocks: int, t_eps: float):
    """The mask ratio of each block as distill.distill_loss draws it (numpy)."""
    return np.sort(t_eps + (1 - t_eps) * rng.uniform(size=(rows, blocks)), axis=-1)


def answer_lengths(batch: dict, prompt_length: int, eos: int) -> np.ndarray:
    """[rows] answer tokens of each row (response tokens before the first end-of-text)."""
    resp = batch["tokens"][:, prompt_length:]
    is_eos = resp == eos
    return np.where(is_eos.any(1), is_eos.argmax(1), resp.shape[1])


def training_states(dc, n_batches: int, *, ratios_fn=None, policy: str = "fits",
                    seed: int = 0) -> dict:
    """Per answer block index: how often it is trained, how masked its left context is,
    and the masked answer tokens it supervises, over n_batches drawn as the Distiller
    draws them (bucket policy `policy`). ratios_fn(rng, lengths, blocks) -> (ratios
    [rows, blocks], queried [rows, blocks] bool) replaces the sorted draw (to measure a
    new sampling the same way)."""
    from asynclane_jax.testbed import tasks
    from asynclane_jax.testbed import tokenizer as tok
    from asynclane_jax.testbed.train import BucketedStream

    eos = tok.special_ids()["eos_token_id"]
    stream = tasks.problem_stream(seed=dc.seed + 1, families=dc.task_set,
                                  weights=dc.family_weights)
    buckets = BucketedStream(stream, dc.buckets, policy, families=dc.task_set, seed=dc.seed)
    rng = np.random.default_rng(dc.seed)
    mrng = np.random.default_rng(seed + 1)
    nb = 512 // BLOCK
    per = {k: {"blocks": 0, "left_masked": [], "masked_answer_tokens": 0,
               "clean_left_masked_answer_tokens": 0, "long_row_ratio": [],
               "long_row_left": [], "long_row_queried": []}
           for k in range(nb)}
    lengths = []
    for _ in range(n_batches):
        batch = buckets.batch(rng)
        n_resp = batch["tokens"].shape[1] - dc.prompt_length
        blocks = n_resp // BLOCK
        lens = answer_lengths(batch, dc.prompt_length, eos)
        lengths.extend(int(x) for x in lens)
        ratios, queried = ((sorted_ratios(mrng, len(lens), blocks, dc.t_eps),
                            np.ones((len(lens), blocks), bool)) if ratios_fn is None
                           else ratios_fn(mrng, lens, blocks))
        col_ratio = np.repeat(ratios, BLOCK, axis=1)
        masked = mrng.uniform(size=col_ratio.shape) < col_ratio
        for r, n_ans in enumerate(lens):
            for k in range(-(-int(n_ans) // BLOCK)):
                lo, hi = k * BLOCK, min((k + 1) * BLOCK, int(n_ans))
                left = float(masked[r, :lo].mean()) if lo else 0.0
                # the masked answer tokens the loss reads (a block it does not query
                # supervises nothing)
                sup = int(masked[r, lo:hi].sum()) if queried[r, k] else 0
                per[k]["blocks"] += 1
                per[k]["left_masked"].append(left)
                per[k]["masked_answer_tokens"] += sup
                if n_ans > FAR:
                    per[k]["long_row_ratio"].append(float(ratios[r, k]))
                    per[k]["long_row_left"].append(left)
                    per[k]["long_row_queried"].append(bool(queried[r, k]))
                if left == 0.0:
                    per[k]["clean_left_masked_answer_tokens"] += sup
    out = {}
    for k, d in per.items():
        lm = np.asarray(d["left_masked"])
        lr = np.asarray(d["long_row_ratio"])
        ll = np.asarray(d["long_row_left"])
        lq = np.asarray(d["long_row_queried"], bool)
        out[k] = {"answer_blocks_per_batch": d["blocks"] / n_batches,
                  "masked_answer_tokens_per_batch": d["masked_answer_tokens"] / n_batches,
                  "clean_left_masked_answer_tokens_per_batch":
                      d["clean_left_masked_answer_tokens"] / n_batches,
                  "left_masked_mean": float(lm.mean()) if len(lm) else None,
                  "left_clean_share": float((lm == 0).mean()) if len(lm) else None,
                  "left_at_most_5pct_share": float((lm <= 0.05).mean()) if len(lm) else None,
                  # this block's own mask ratio in rows whose answer is over 256 tokens
                  # (decoding takes every block of such a row from fully masked down)
                  "long_rows": len(lr),
                  "long_row_ratio_mean": float(lr.mean()) if len(lr) else None,
                  "long_row_ratio_at_least_half_share":
                      float((lr >= 0.5).mean()) if len(lr) else None,
                  "long_row_ratio_at_least_0.9_share":
                      float((lr >= 0.9).mean()) if len(lr) else None,
                  # per batch: this block of a long answer at ratio >= 0.5 with at most 5%
                  # of its left context masked (the state decoding writes it from), and
                  # read by the loss
                  "long_row_decode_like_per_batch":
                      float(((lr >= 0.5) & (ll <= 0.05) & lq).sum() / n_batches)}
    lengths = np.asarray(lengths)
    return {"per_block": out, "rows_per_batch": len(lengths) / n_batches,
            "answer_over_256_rows_per_batch": float((lengths > FAR).sum() / n_batches),
            "answer_over_256_share_of_rows": float((lengths > FAR).mean()),
            "answer_length_quantiles": {q: float(np.quantile(lengths, q))
                                        for q in (0.5, 0.9, 0.99, 1.0)}}


# --------------------------------------------------------------------------- decoding

_calls: list[dict] = []


def _record(before, after, logits, targets, serve):
    _calls.append({"before": np.asarray(before), "after": np.asarray(after),
                   "logits": np.asarray(logits), "targets": np.asarray(targets),
                   "serve": np.asarray(serve)})


def recording_schedule(**options):
    """A d2f schedule that hands every call's canvas before and after its update, and
    the call's logits, to `_record`."""
    import jax

    from asynclane_jax.decoding.d2f import D2FSchedule

    @dataclasses.dataclass(frozen=True)
    class RecordingD2F(D2FSchedule):
        def update(self, ctx, canvas, state, out, key):
            new, st = super().update(ctx, canvas, state, out, key)
            jax.debug.callback(_record, canvas, new, out.logits, out.targets, out.serve)
            return new, st

    return RecordingD2F(gen_length=512, **options)


def _forward_fn(model, block_causal: bool, P: int):
    import jax
    import jax.numpy as jnp

    @jax.jit
    def f(canvas, pad_len):
        b, T = canvas.shape
        cols = jnp.arange(T)[None, :]
        pos = jnp.maximum(cols - pad_len[:, None], 0)
        ids = None
        if block_causal:
            ids = jnp.broadcast_to(jnp.where(cols < P, 0, (cols - P) // BLOCK + 1), (b, T))
        return model(canvas, positions=pos, key_mask=cols >= pad_len[:, None], block_ids=ids)

    return f


def decode_states(student_name: str, teacher, problems, options: dict, *,
                  check_cache: bool, agreement: bool = True) -> dict:
    """Decodes `problems` with the d2f sampler and reads every call (see the module
    docstring, items 2 and 3)."""
    import jax
    import jax.numpy as jnp

    import asynclane_jax
    from asynclane_jax.decoding import generate
    from asynclane_jax.testbed import evaluate, tasks

    student, _, cfg = asynclane_jax.load(student_name)
    mask, shift = cfg.mask_token_id, int(cfg.logit_shift)
    _calls.clear()
    res = generate(student, evaluate.prompts_for(problems), sampler=recording_schedule(
        **options), pad_batch=False)
    jax.effects_barrier()
    calls = list(_calls)
    T = calls[0]["before"].shape[1]
    P = T - 512
    pad_len = np.asarray([P - len(p) for p in evaluate.prompts_for(problems)], np.int32)
    t_fwd = _forward_fn(teacher, False, P)
    s_fwd = _forward_fn(student, True, P) if check_cache else None
    nb = 512 // BLOCK
    left_at_commit = {k: [] for k in range(nb)}
    agree = {k: [0, 0] for k in range(nb)}  # [agreeing commits, commits]
    worst = 0.0
    for c in calls:
        before, after = c["before"], c["after"]
        gen_b = before[:, P:] == mask
        # Commits at positions the call predicted (not the end-of-text written into
        # blocks never added when a row ends).
        T_ = before.shape[1]
        predicted = np.zeros_like(before, bool)
        rr, qq = np.nonzero(c["targets"] < T_)
        predicted[rr, c["targets"][rr, qq]] = True
        committed = (gen_b & (after[:, P:] != mask) & c["serve"][:, None]
                     & predicted[:, P:])
        if not committed.any():
            continue
        t_top = (np.asarray(t_fwd(jnp.asarray(before), jnp.asarray(pad_len))).argmax(-1)
                 if agreement else None)  # [b, T]: column c predicts c + shift
        for r, j in zip(*np.nonzero(committed)):
            k = j // BLOCK
            left_at_commit[k].append(float(gen_b[r, :k * BLOCK].mean()) if k else 0.0)
            if agreement:
                agree[k][0] += int(after[r, P + j] == t_top[r, P + j - shift])
                agree[k][1] += 1
        if check_cache:
            s_logits = np.asarray(s_fwd(jnp.asarray(before), jnp.asarray(pad_len)))
            valid = (c["targets"] < T) & c["serve"][:, None]
            rows, q = np.nonzero(valid)
            d = np.abs(c["logits"][rows, q] - s_logits[rows, c["targets"][rows, q] - shift])
            worst = max(worst, float(d.max(initial=0.0)))
    from asynclane_jax.testbed import tokenizer as tok

    right = [bool(tasks.check(p, tasks.response_text(tok.decode_tokens(row))))
             for p, row in zip(problems, res.tokens)]
    per_block = {}
    for k in range(nb):
        lm = np.asarray(left_at_commit[k])
        if not len(lm):
            continue
        per_block[k] = {"commits": int(len(lm)), "left_masked_mean": float(lm.mean()),
                        "left_clean_share": float((lm == 0).mean()),
                        "left_at_most_5pct_share": float((lm <= 0.05).mean()),
                        "agree_with_teacher": (agree[k][0] / agree[k][1]
                                               if agree[k][1] else None)}
    far = [x for k in range(FAR // BLOCK, nb) for x in left_at_commit[k]]
    far_agree = [sum(agree[k][i] for k in range(FAR // BLOCK, nb)) for i in (0, 1)]
    return {"options": options, "right": int(sum(right)), "n": len(problems),
            "calls": len(calls), "per_block": per_block,
            "far": {"commits": len(far),
                    "left_masked_mean": float(np.mean(far)) if far else None,
                    "left_clean_share": float(np.mean(np.asarray(far) == 0)) if far else None,
                    "agree_with_teacher": (far_agree[0] / far_agree[1]
                                           if far_agree[1] else None)},
            "max_abs_cached_minus_full": worst if check_cache else None}


# --------------------------------------------------------------------------- probes

def probe_canvases(problems, P: int, seed: int = 0, t_eps: float = 0.05):
    """(canvas [n, P + 512], pad_len [n], block [n], condition [n], reference [n, 512])
    of the controlled long-answer canvases (module docstring, item 4)."""
    from asynclane_jax.testbed import tokenizer as tok

    ids = tok.special_ids()
    mask, eos = ids["mask_token_id"], ids["eos_token_id"]
    rng = np.random.default_rng(seed)
    canv, pads, blk, cond, refs = [], [], [], [], []
    for p in problems:
        prompt = tok.prompt_ids(p.prompt)
        ref = np.full(512, eos, np.int32)
        ans = tok.encode(p.response)
        ref[:len(ans)] = ans
        head = np.concatenate([np.full(P - len(prompt), eos, np.int32), prompt])
        for k in range(-(-len(ans) // BLOCK)):
            lo, hi = k * BLOCK, (k + 1) * BLOCK
            for c in ("clean left", "clean left, half of the block shown", "training"):
                gen = np.full(512, mask, np.int32)
                if c == "training":
                    r = np.repeat(sorted_ratios(rng, 1, 512 // BLOCK, t_eps)[0], BLOCK)
                    gen = np.where(rng.uniform(size=512) < r, mask, ref)
                    gen[lo:hi][rng.uniform(size=BLOCK) < 0.5] = mask  # some masks in block k
                else:
                    gen[:lo] = ref[:lo]
                    if c.startswith("clean left, half"):
                        show = rng.permutation(BLOCK)[:BLOCK // 2]
                        gen[lo + show] = ref[lo + show]
                canv.append(np.concatenate([head, gen]))
                pads.append(P - len(prompt))
                blk.append(k)
                cond.append(c)
                refs.append(ref)
    return (np.stack(canv), np.asarray(pads, np.int32), np.asarray(blk), np.asarray(cond),
            np.stack(refs))


def probe(student_name: str, teacher, problems, P: int, chunk: int = 16,
          conditions=None) -> dict:
    import jax.numpy as jnp

    import asynclane_jax
    from asynclane_jax.testbed import tokenizer as tok

    student, _, cfg = asynclane_jax.load(student_name)
    shift = int(cfg.logit_shift)
    vocab = tok.decode_tokens(range(cfg.vocab_size))
    is_label = np.asarray([len(w) > 2 and w[0] == "(" and w[-1] == ")" and w[1:-1].isdigit()
                           for w in vocab])
    canvas, pads, blk, cond, refs = probe_canvases(problems, P)
    if conditions:
        keep = np.isin(cond, list(conditions))
        canvas, pads, blk, cond, refs = (a[keep] for a in (canvas, pads, blk, cond, refs))
    s_fwd, t_fwd = _forward_fn(student, True, P), _forward_fn(teacher, False, P)
    s_top, t_top = [], []
    n = len(canvas)
    for i in range(0, n, chunk):
        c = canvas[i:i + chunk]
        pl = pads[i:i + chunk]
        if len(c) < chunk:  # one compiled shape
            c = np.concatenate([c, np.repeat(c[-1:], chunk - len(c), 0)])
            pl = np.concatenate([pl, np.repeat(pl[-1:], chunk - len(pl))])
        for fwd, out in ((s_fwd, s_top), (t_fwd, t_top)):
            top = np.asarray(fwd(jnp.asarray(c), jnp.asarray(pl))).argmax(-1)
            out.append(top[:, P - shift:P - shift + 512])
    s_top, t_top = np.concatenate(s_top)[:n], np.concatenate(t_top)[:n]
    gen = canvas[:, P:]
    out = {}
    for c in dict.fromkeys(cond):
        rows_c = {}
        for k in sorted(set(blk[cond == c].tolist())):
            sel = np.nonzero((cond == c) & (blk == k))[0]
            pos = np.zeros((len(sel), 512), bool)
            pos[:, k * BLOCK:(k + 1) * BLOCK] = True
            m = pos & (gen[sel] == cfg.mask_token_id) & (refs[sel] != cfg.eos_token_id)
            lab = m & is_label[refs[sel]]
            s, t, r = s_top[sel], t_top[sel], refs[sel]

            def rate(a, b, where):
                return float((a == b)[where].mean()) if where.any() else None

            rows_c[k] = {"canvases": int(len(sel)), "positions": int(m.sum()),
                         "student_teacher": rate(s, t, m), "student_reference": rate(s, r, m),
                         "teacher_reference": rate(t, r, m),
                         "labels": int(lab.sum()),
                         "label_student_reference": rate(s, r, lab),
                         "label_teacher_reference": rate(t, r, lab)}
        out[c] = rows_c
    return out


def decode_state_draw(p_decode: float = 0.75, in_flight: int = 4, t_eps: float = 0.05):
    """ratios_fn for `training_states`: train_d2f.decode_state_ratios, the draw of
    `python experiments/train_d2f.py --states decode` (its defaults)."""
    import jax
    import jax.numpy as jnp
    from train_d2f import decode_state_ratios

    def fn(rng, lengths, blocks):
        answer = np.clip(np.asarray(lengths) // BLOCK + 1, 1, blocks)
        key = jax.random.key(int(rng.integers(2**31)))
        ratios, queried = decode_state_ratios(key, jnp.asarray(answer, jnp.int32), blocks,
                                              t_eps=t_eps, p_decode=p_decode,
                                              in_flight=in_flight)
        return np.asarray(ratios), np.asarray(queried)

    return fn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny-llada-v4b-d2f,tiny-dream-v4-d2f")
    ap.add_argument("--n-long", type=int, default=16)
    ap.add_argument("--train-batches", type=int, default=4000)
    ap.add_argument("--quick", action="store_true",
                    help="a trial student: d2f's defaults only, no teacher agreement or "
                    "cache check in the decode, the clean-left probe only")
    ap.add_argument("--out", default=str(RESULTS / "d2f_contexts.json"))
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: "
                    "training, decode, probe")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))

    import asynclane_jax
    from asynclane_jax import checkpoint
    from asynclane_jax.testbed import distill, tasks

    path = pathlib.Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else {"models": {}}
    command = shlex.join(["python", "experiments/d2f_contexts.py",
                          *(sys.argv[1:] if argv is None else argv)])
    earlier = old.get("commands") or ([old["command"]] if "command" in old else [])
    out = {"commands": earlier + [command],
           "n_long": args.n_long, "train_batches": args.train_batches,
           "models": dict(old["models"])}
    for name in args.models.split(","):
        t0 = time.time()
        cfg_path = checkpoint.resolve(name) / checkpoint.CONFIG_FILE
        dcd = json.loads(cfg_path.read_text())["distill"]
        dc = distill.DistillConfig(**{**dcd, "regions": tuple(map(tuple, dcd["regions"])),
                                      "buckets": tuple(map(tuple, dcd["buckets"])),
                                      "family_weights": tuple(dcd["family_weights"])})
        run_log = RESULTS / f"d2f_{name}.json"  # a shipped student's training log
        steps = (json.loads(run_log.read_text())["run"]["steps"] if run_log.exists()
                 else None)
        # Parts skipped in this run keep what an earlier run wrote.
        entry = {**old["models"].get(name, {}), "teacher": dc.teacher, "steps": steps}
        task_set = tasks.model_task_set(name)
        pool = tasks.heldout(400, task_set)
        long = [p for p in pool if tasks.answer_tokens(p) > FAR][:args.n_long]
        held = tasks.heldout(200, task_set)
        entry["heldout_200_over_256"] = sum(tasks.answer_tokens(p) > FAR for p in held)
        entry["long_answer_tokens"] = [tasks.answer_tokens(p) for p in long]
        if "training" not in skip and steps:
            tr = training_states(dc, args.train_batches)
            tr["over_the_run"] = {
                "masked_answer_tokens_past_256": steps * sum(
                    v["masked_answer_tokens_per_batch"] for k, v in tr["per_block"].items()
                    if k >= FAR // BLOCK),
                "clean_left_masked_answer_tokens_past_256": steps * sum(
                    v["clean_left_masked_answer_tokens_per_batch"]
                    for k, v in tr["per_block"].items() if k >= FAR // BLOCK),
                "rows_with_answer_over_256": steps * tr["answer_over_256_rows_per_batch"]}
            entry["training"] = tr
            # The same measurement for train_d2f.py's new default draw (--states decode,
            # --bucket-policy smallest), per the shipped student's step count.
            new = training_states(dc, args.train_batches, ratios_fn=decode_state_draw(),
                                  policy="smallest")
            new["over_the_run"] = {
                "masked_answer_tokens_past_256": steps * sum(
                    v["masked_answer_tokens_per_batch"] for k, v in new["per_block"].items()
                    if k >= FAR // BLOCK),
                "clean_left_masked_answer_tokens_past_256": steps * sum(
                    v["clean_left_masked_answer_tokens_per_batch"]
                    for k, v in new["per_block"].items() if k >= FAR // BLOCK),
                "rows_with_answer_over_256": steps * new["answer_over_256_rows_per_batch"]}
            entry["training_decode_states"] = new
            print(f"{name}: training states {time.time() - t0:.0f}s", flush=True)
        teacher = asynclane_jax.load(dc.teacher)[0]
        if "decode" not in skip:
            entry["decode"] = {}
            settings = (("defaults", {}),) if args.quick else (
                ("defaults", {}), ("one block in flight", {"max_active_blocks": 1}))
            for label, options in settings:
                entry["decode"][label] = decode_states(
                    name, teacher, long, options, check_cache=label == "defaults"
                    and not args.quick, agreement=not args.quick)
                print(f"{name} {label}: {entry['decode'][label]['right']}/{len(long)} right, "
                      f"{time.time() - t0:.0f}s", flush=True)
        if "probe" not in skip:
            entry["probe"] = probe(name, teacher, long, P=dc.prompt_length,
                                   conditions=("clean left",) if args.quick else None)
            print(f"{name}: probe {time.time() - t0:.0f}s", flush=True)
        out["models"][name] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
