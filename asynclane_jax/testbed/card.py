"""Model cards (README.md) for the shipped testbed models."""

from __future__ import annotations

import functools
import json
import pathlib

from asynclane_jax.testbed import tasks


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _span(r) -> str:
    return f"{r[0]}" if r[0] == r[1] else f"{r[0]}–{r[1]}"


def _examples(sample: list[tasks.Problem], families=tasks.FAMILIES) -> list[str]:
    """The shortest problem of each family in `sample`, as prompt and response lines."""
    from asynclane_jax.testbed import tokenizer as tok

    out, width = [], max(6, *(len(f) for f in families))
    for fam in families:
        p = min((q for q in sample if q.family == fam), key=tasks.answer_tokens)
        resp = p.response.replace("\n", "\\n")
        out += [f"{fam:<{width}} {tok.USER} {p.prompt} {tok.ASSISTANT}",
                f"{'':<{width}} {resp} {tok.EOS} ..."]
    return out


def _long_names(task_set: str) -> str:
    """The long families of a task set, as the cards name them: "walk and table"."""
    return " and ".join(f for f in tasks.families_of(task_set) if f in tasks.LINE_FAMILIES)


def _objective(tc: dict) -> str:
    """The training objective, as the card's Training section opens."""
    if tc.get("objective", "diffusion") == "causal":
        return ("Next-token prediction (an autoregressive model: causal attention over the "
                "whole canvas, cross-entropy of each answer token and of the first "
                "end-of-text from the output one column before; decoded by the `ar` "
                "sampler)")
    if tc.get("objective") == "block":
        return (f"Block diffusion (LLaDA2's objective: blocks of {tc.get('block_length', 32)} "
                "columns from each row's first prompt token; each block draws its own "
                "t ~ U(ε, 1] and masks its response tokens with probability t; the model "
                "reads the noisy canvas and a clean copy at the same positions, a noisy "
                "block attending to itself and to the clean blocks before it; "
                "cross-entropy on masked tokens weighted 1/t, the response region padded "
                "with end-of-text to its end; decoded by the `llada2` sampler)")
    return ("Masked diffusion (LLaDA's objective: t ~ U(ε, 1], each response token masked "
            "with probability t, cross-entropy on masked tokens weighted 1/t, the response "
            "region padded with end-of-text to its end)")


def _curriculum(tc: dict) -> str:
    out = ""
    if tc.get("t_ramp"):
        out += (f" Mask-ratio curriculum: t ~ U(ε, t_max] with t_max rising linearly from "
                f"{tc['t_max_start']:g} to 1 over the first {100 * tc['t_ramp']:g}% of the "
                "budget, so that early batches mask few tokens.")
    if tc.get("lines_curriculum"):
        start, ramp_from, ramp_to = tc["lines_curriculum"]
        long = _long_names(tc.get("task_set", "v2"))
        out += (f" Line-count curriculum: {long} problems have at most {start:g} working "
                f"lines until {100 * ramp_from:g}% of the budget, rising linearly "
                f"to all of them at {100 * ramp_to:g}% (longer ones are redrawn shorter).")
    if tc.get("shuffle_statements"):
        out += (f" Statement order: {100 * tc['shuffle_statements']:g}% of the chain and list "
                "training problems list their statements in a random order (the answer "
                "keeps label order), so a line's statement can be found only by its label.")
    if tc.get("family_weights"):
        families = tasks.families_of(tc.get("task_set", "v1"))
        total = sum(tc["family_weights"])
        out += (" Family mix of the training stream: " + ", ".join(
            f"{f} {100 * w / total:.1f}%" for f, w in zip(families, tc["family_weights"]))
            + " of the problems drawn (the held-out split still alternates them).")
    return out


def _curriculum_flags(tc: dict) -> str:
    """The train_testbed.py flags that reproduce tc's curriculum and batch mix (no
    mask-ratio flags for a causal model: it masks nothing)."""
    flags = "" if tc.get("objective", "diffusion") == "causal" else (
        f" --t-max-start {tc.get('t_max_start', 1.0):g} --t-ramp {tc.get('t_ramp', 0.0):g}")
    from asynclane_jax.testbed.train import V2_BUCKETS, V3_BUCKETS, long_frac

    if tc.get("buckets"):
        flags += f" --task-set {tc.get('task_set', 'v1')}"
        if tc.get("bucket_policy", "smallest") != "smallest":
            flags += f" --bucket-policy {tc['bucket_policy']}"
        if tc.get("lines_curriculum"):
            flags += " --lines-curriculum " + ",".join(f"{x:g}" for x in tc["lines_curriculum"])
        if tc.get("shuffle_statements"):
            flags += f" --shuffle-statements {tc['shuffle_statements']:g}"
        if tc.get("family_weights"):
            flags += " --family-weights " + ",".join(f"{w:g}" for w in tc["family_weights"])
        default = V2_BUCKETS if tc.get("task_set") == "v2" else V3_BUCKETS
        weights = [b[3] for b in tc["buckets"]]
        if weights != [b[3] for b in default]:
            flags += " --bucket-weights " + ",".join(f"{w:g}" for w in weights)
        return flags
    return flags + f" --long-frac {long_frac(tc['regions']):g}"


def _v1_task(sample) -> list[str]:
    lines = (min(len(p.lines) for p in sample), max(len(p.lines) for p in sample))
    lengths = (min(len(p.response.split(" ")) for p in sample),
               max(len(p.response.split(" ")) for p in sample))
    return [
        "Two families, alternating in the held-out split (`asynclane_jax.testbed.tasks`); "
        "every number 0..99, word, label and newline is one token:", "",
        "```", *_examples(sample), "```", "",
        f"Math problems have {_span(tasks.MATH_STEPS)} events, programs "
        f"{_span(tasks.CODE_STEPS)} statements; values stay in "
        f"0..{tasks.MAX_VALUE}, operands 1..{tasks.MAX_OPERAND}; all prompts of a family "
        "have one length, so the statement a working line reads sits at a fixed "
        "distance from it. Responses are "
        f"{_span(lines)} newline-separated lines ({_span(lengths)} tokens); the rest of "
        "the canvas is end-of-text. "
        "An answer is correct when the last line before end-of-text is exactly "
        "`answer : N` (`asynclane_jax.testbed.check`). The held-out split has its own "
        f"seed and the training stream skips its first {tasks.HELDOUT_POOL} prompts.", ""]


def split_section(task_set: str, n: int = 1000) -> list[str]:
    """The held-out split's family and answer-length statistics (computed, not typed):
    a table per family, the bucket counts and a text histogram."""
    stats = tasks.split_stats(tasks.heldout(n, task_set))
    out = [f"Held-out split, first {n} problems (`tasks.split_stats`): "
           f"{100 * stats['frac_over_128']:.1f}% of answers are longer than 128 tokens and "
           f"{100 * stats['frac_over_256']:.1f}% longer than 256; the longest prompt has "
           f"{stats['max_prompt_tokens']} tokens.", "",
           "| family | problems | answer tokens (min / mean / max) | working lines (mean) |",
           "|---|--:|---|--:|"]
    for fam, f in stats["families"].items():
        out.append(f"| {fam} | {f['n']} | {f['min_tokens']} / {f['mean_tokens']} / "
                   f"{f['max_tokens']} | {f['mean_lines']:.1f} |")
    out += ["", "| answer tokens | " + " | ".join(stats["buckets"]) + " |",
            "|---|" + "--:|" * len(stats["buckets"]),
            "| problems | " + " | ".join(str(v) for v in stats["buckets"].values()) + " |",
            "", "Answer-length histogram (tokens, one # per 10 problems):", "", "```"]
    w = stats["histogram"]["bin_width"]
    for b, c in enumerate(stats["histogram"]["counts"]):
        out.append(f"{b * w + 1:>4}-{(b + 1) * w:<4} {c:>4} " + "#" * round(c / 10))
    return out + ["```", ""]


# What differs between the task sets with long families: how the two long families
# are described, and what the held-out note adds.
def _header_text(walk: str, table: str, line: str, labels: str = "", after: str = ""):
    """The description of v3's walk and table as a set names them (v4: counting down)."""
    return (f"two long ones of one surface form whose prompt is a fixed-length header{labels}, "
            f"{walk} (every working line moves the previous line's result by the header's "
            f"step, turning at 0 and 9: chained) and {table} ({line} adds the header's operand "
            "to the digit i - 1 places after the header's start, mod 10: every line reads "
            f"only the header and its own label){after}",
            f" (for {walk} and {table} a prompt is exactly its (start, step, line count) "
            "triple)")


_LONG_FAMILY_TEXT = {
    "v2": ("two long ones of one surface form, chain (every working line reads the "
           "previous line's result) and list (every line reads only its own statement in "
           "the prompt)", ""),
    "v3": _header_text("walk", "table", "line i"),
    "v4": _header_text("walk-down", "table-down", "the i-th line",
                       " and whose labels count down to (1)",
                       "; they are v3's walk and table with the labels reversed, so the "
                       "last line is always (1)"),
}


def _long_task(task_set: str, sample) -> list[str]:
    """The card's task section of a set with long families (v2, v3, v4)."""
    described, held_note = _LONG_FAMILY_TEXT[task_set]
    families = tasks.families_of(task_set)
    long = _long_names(task_set)
    return [
        f"The task set {task_set} (`asynclane_jax.testbed.tasks`): the two short families "
        f"of the first models (math, code) and {described}, {_span(tasks.LONG_STEPS)} "
        "working lines each. The families alternate in the held-out split; every number "
        "0..99, word, label and newline is one token. The shortest problem of each family "
        "in a training sample:", "",
        "```", *_examples(sample, families), "```", "",
        f"In {long} each line opens with a connective (then / next / also) and "
        "restates its result after a consequence word (so / thus / hence), each drawn "
        "uniformly: free-choice positions, graded right whichever member is written. "
        f"{long} are correct when every line is right (free choices aside) and "
        "nothing is added; math and code when the last line before end-of-text is "
        "`answer : N` (`asynclane_jax.testbed.check`). The held-out split has its own "
        f"seed and the training stream skips its first {tasks.HELDOUT_POOL} prompts"
        f"{held_note}.", "",
        *split_section(task_set)]


TASK_SECTIONS = {"v1": _v1_task, **{name: functools.partial(_long_task, name)
                                     for name in _LONG_FAMILY_TEXT}}


def train_command(tc: dict) -> str:
    """The experiments/train_testbed.py command that trains a run of this config."""
    base = "tiny-llada" if tc["family"] in ("llada", "llada2") else "tiny-dream"
    objective = tc.get("objective", "diffusion")
    causal = objective == "causal"
    flags = ([f"--model {base}"] if objective != "block" else []) + (
        [f"--objective {objective}"] if objective != "diffusion" else []) + [
        f"--minutes {tc['minutes']:g}"]
    task_set = tc.get("task_set", "v1")
    default = ("tiny-ar-v4" if causal else "tiny-llada2-v4" if objective == "block"
               else base if task_set == "v1" else f"{base}-{task_set}")
    if tc["name"] != default:
        flags.append(f"--name {tc['name']}")
    from asynclane_jax.testbed.train import TrainConfig

    if tc.get("lr", TrainConfig.lr) != TrainConfig.lr:  # every shipped card's lr so far
        flags.append(f"--lr {tc['lr']:g}")
    if tc.get("init_from"):
        flags.append(f"--init-from {tc['init_from']}")  # it sets the architecture
    else:
        flags += [f"--d-model {tc['d_model']}", f"--mlp-hidden {tc['mlp_hidden']}"]
        if tc.get("n_layers", 6) != 6:
            flags.append(f"--n-layers {tc['n_layers']}")
        flags.append({True: "--qkv-bias", False: "--no-qkv-bias", None: ""}[tc.get("qkv_bias")])
    return ("python experiments/train_testbed.py " + " ".join(f for f in flags if f)
            + _curriculum_flags(tc))


def _source_family(name: str) -> str | None:
    """The family of a warm start's source model, None when it cannot be read."""
    from asynclane_jax import checkpoint

    try:
        return checkpoint.read_config(checkpoint.resolve(name))[0].family
    except (OSError, ValueError):
        return None


def _warm_start(tc: dict) -> str:
    if not tc.get("init_from"):
        return ""
    source = tc["init_from"]
    text = (f"The run started from the weights of `{source}` (same architecture; "
            "the ids the vocabulary gained since start from a random initialisation), so "
            f"its training time adds to that model's (see `{source}`'s card). ")
    if tc["family"] == "dream" and _source_family(source) == "llada":
        text += (f"`{source}` is LLaDA-style (a masked position is read from its own "
                 "output); this model reads it from the output one position earlier, so "
                 "the run learns the shift from weights that did not have it (Dream-7B "
                 "was adapted the same way, from an autoregressive model's weights). ")
    return text


def _label(e: dict) -> str:
    opts = ", ".join(f"{k}={v}" for k, v in (e.get("options") or {}).items())
    return e["sampler"] + (f" ({opts})" if opts else "")


def _shapes(tc: dict) -> str:
    if tc.get("buckets"):
        return ("Length buckets (prompt tokens + response region × rows, probability of "
                "a step): " + ", ".join(f"{b[0]}+{b[1]}×{b[2]} ({b[3]})" for b in tc["buckets"])
                + ("; a bucket takes any problem that fits it (short answers train with long "
                   "end-of-text tails too)" if tc.get("bucket_policy") == "fits" else
                   "; a problem goes to the smallest bucket it fits")
                + ", prompts left-padded.")
    return ("Batch shapes (response region, rows, probability): "
            + ", ".join(f"{r[0]}×{r[1]} ({r[2]})" for r in tc["regions"])
            + f"; prompts left-padded to {tc['prompt_length']}.")


def render(name: str, config: dict, log: dict, evals: list[dict],
           attempts: list[dict] | None = None, notes: str = "",
           hardware: str = "a 2-core CPU") -> str:
    """The card's markdown.

    Args:
      name: model name.
      config: the folder's config.json.
      log: the training log (Trainer.log_dict()).
      evals: results of asynclane_jax.testbed.evaluate.evaluate.
      attempts: every training attempt as {"task", "size", "minutes", "accuracy", "note"}.
      notes: free text appended at the end.
      hardware: where it was trained, e.g. "one core of a 2-core CPU".
    """
    m = config["model"]
    tc = log["config"]
    task_set = tc.get("task_set", "v1")
    families = tasks.families_of(task_set)
    sample = tasks.split("train", 200, task_set)
    minutes = log["elapsed_s"] / 60
    bias = "q/k/v biases" if m["qkv_bias"] else "no biases"
    attention = ("grouped-query attention" if m["n_kv_heads"] < m["n_heads"]
                 else "multi-head attention")
    causal = bool(m.get("causal"))
    if m["family"] == "llada2":
        groups = (f", top-{m['n_experts_per_tok']} of the best {m['n_topk_groups']} of "
                  f"{m['n_expert_groups']} groups" if m["n_expert_groups"] > 1 else
                  f", top-{m['n_experts_per_tok']}")
        family = (f"LLaDA2-style: {attention} with QK-norm, RoPE on {m['rotary_dim']} of "
                  f"{m['head_dim']} channels per head, no biases, block-causal attention; "
                  + ("the first layer dense" if m["first_dense_layers"] == 1 else
                     f"the first {m['first_dense_layers']} layers dense")
                  + ", then mixtures of "
                  f"{m['n_experts']} experts{groups}, {m['n_shared_experts']} shared, "
                  f"sigmoid routing scaled by {m['routed_scaling']:g}")
    elif causal:
        family = (f"{attention}, {bias}, causal attention, next-token logits (the token at "
                  "position i is read from the output at i - 1), the size of the "
                  f"{'LLaDA' if m['family'] == 'llada' else 'Dream'}-style testbed models")
    else:
        family = (f"LLaDA-style: multi-head attention, {bias}, same-position logits"
                  if m["family"] == "llada" else
                  f"Dream-style: {attention}, {bias}, shifted logits "
                  "(the token at position i is read from the output at i - 1)")
    kind = ("autoregressive language model" if causal else
            "block-diffusion mixture-of-experts language model" if m["family"] == "llada2"
            else "masked-diffusion language model")
    out = [f"# {name}", "",
           f"A tiny {kind} ({family}) trained "
           + (f"from `{tc['init_from']}` (a warm start: its weights, see Training) "
              if tc.get("init_from") else "from scratch ")
           + "on the testbed's synthetic reasoning tasks. It exists so that every sampler of "
           "asynclane-jax can be run and compared on a real workload on a CPU; it goes "
           "through the same loading path as a converted 8B checkpoint: "
           f"`asynclane_jax.load(\"{name}\")`.", "",
           "## Task", "",
           *TASK_SECTIONS[task_set](sample),
           "## Model", "",
           "| field | value |", "|---|---|",
           f"| parameters | {log['params']:,} (float32) |",
           f"| layers × width | {m['n_layers']} × {m['d_model']} |",
           f"| heads (query / key-value) × head dim | {m['n_heads']} / {m['n_kv_heads']} × "
           f"{m['head_dim']} |",
           f"| MLP (SwiGLU) hidden | {m['mlp_hidden']} |" if m["family"] != "llada2" else
           f"| MLP (SwiGLU) hidden | dense layers {m['mlp_hidden']}; each expert "
           f"{m['moe_hidden']}, shared {m['moe_hidden'] * m['n_shared_experts']} |",
           f"| vocabulary | {m['vocab_size']} (mask {m['mask_token_id']}, "
           f"eos = pad {m['eos_token_id']}) |",
           f"| max sequence length | {m['max_seq_len']} |", "",
           "## Training", "",
           _objective(tc) + ", AdamW "
           f"(lr {tc['lr']}, warmup {tc['warmup_steps']} steps, cosine over the wall-clock "
           f"budget to {tc['min_lr_ratio']}×, b2 {tc['b2']}, weight decay "
           f"{tc['weight_decay']}, clip {tc['clip_norm']}). " + _shapes(tc)
           + _curriculum(tc), "",
           f"Steps: {log['step']:,}; training time: {minutes:.1f} min of training steps "
           f"(monitoring excluded) on {hardware}. " + _warm_start(tc)
           + f"Command: `{train_command(tc)}`. Loss curve: "
           f"`experiments/results/testbed/testbed_{name}.png`.", "",
           "## Held-out accuracy", "",
           "| sampler | gen length | problems | exact answer | " + " | ".join(families)
           + " | lines exact | model calls / token | tokens/s |",
           "|---|---|---|---|" + "---|" * len(families) + "---|---|---|"]
    for e in evals:
        out.append(
            f"| {_label(e)} | {e['gen_length']} | {e['n']} | {_pct(e['accuracy'])} | "
            + " | ".join(_pct(e.get(f"accuracy_{f}")) for f in families)
            + f" | {_pct(e.get('line_accuracy'))} | {e['nfe_per_token']:.2f} | "
            f"{e['tps']:.0f} |")
    by_length = [e for e in evals if e.get("accuracy_length")]
    if by_length:
        names = [b[0] for b in tasks.LENGTH_BUCKETS]
        out += ["", "By answer length (response tokens of the reference; problems in "
                "brackets):", "",
                "| sampler | gen length | " + " | ".join(names) + " |",
                "|---|---|" + "---|" * len(names)]
        for e in by_length:
            cells = [e["accuracy_length"].get(b) for b in names]
            out.append(f"| {_label(e)} | {e['gen_length']} | " + " | ".join(
                "—" if c is None else f"{_pct(c['accuracy'])} ({c['n']})" for c in cells)
                + " |")
    samplers = {e["sampler"] for e in evals}
    out += ["", *(["Vanilla: steps = gen_length, one token per step, block length 32, "
                   "low-confidence remasking, greedy. "] if "vanilla" in samplers else []),
            *(["ar: greedy, left to right, one position per model call with a K/V cache, "
               "ending at the first end-of-text. "] if "ar" in samplers else []),
            *(["llada2: LLaDA2.0's block diffusion, greedy: blocks of 32 from the first "
               "prompt token, each decoded in up to 32 steps that commit every mask above "
               "the threshold (0.95 unless given), at least one; a finished block's K/V "
               "cached; the row ends after a block holding end-of-text. "]
              if "llada2" in samplers else []),
            "Model calls per token count a row's model calls over its tokens before "
            "end-of-text.", ""]
    mon = log.get("evals") or []
    if mon:
        out += [f"Monitored during training ({tc.get('eval_sampler', 'vanilla')}, gen length "
                f"{tc['eval_gen_length']}, first {tc['eval_n']} held-out problems):", "",
                "| step | minutes | exact answer | lines exact |", "|---|---|---|---|"]
        out += [f"| {e['step']} | {e['t'] / 60:.1f} | {_pct(e['acc'])} | "
                f"{_pct(e['line_acc'])} |" for e in mon]
        out.append("")
    if attempts:
        out += ["## Attempts", "", "| task | size | minutes | accuracy | note |",
                "|---|---|---|---|---|"]
        out += [f"| {a['task']} | {a['size']} | {a['minutes']} | {a['accuracy']} | "
                f"{a.get('note', '')} |" for a in attempts]
        out.append("")
    if notes:
        out += [notes.strip(), ""]
    return "\n".join(out)


def write(folder, log_path, eval_paths, attempts=None, notes: str = "",
          hardware: str = "a 2-core CPU") -> pathlib.Path:
    """Writes README.md into a shipped model folder from JSON logs."""
    folder = pathlib.Path(folder)
    config = json.loads((folder / "config.json").read_text())
    log = json.loads(pathlib.Path(log_path).read_text())
    evals = [json.loads(pathlib.Path(p).read_text()) for p in eval_paths]
    text = render(folder.name, config, log, evals, attempts, notes, hardware)
    (folder / "README.md").write_text(text)
    return folder / "README.md"
