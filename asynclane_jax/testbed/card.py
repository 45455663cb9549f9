"""Model cards (README.md) for the shipped testbed models."""

from __future__ import annotations

import json
import pathlib

from asynclane_jax.testbed import tasks


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def render(name: str, config: dict, log: dict, evals: list[dict],
           attempts: list[dict] | None = None, notes: str = "") -> str:
    """The card's markdown.

    Args:
      name: model name.
      config: the folder's config.json.
      log: the training log (Trainer.log_dict()).
      evals: results of asynclane_jax.testbed.evaluate.evaluate.
      attempts: every training attempt as {"task", "size", "minutes", "accuracy", "note"}.
      notes: free text appended at the end.
    """
    m = config["model"]
    tc = log["config"]
    minutes = log["elapsed_s"] / 60
    family = ("LLaDA-style: multi-head attention, no biases, same-position logits"
              if m["family"] == "llada" else
              "Dream-style: grouped-query attention, q/k/v biases, shifted logits "
              "(the token at position i is read from the output at i - 1)")
    out = [f"# {name}", "",
           f"A tiny masked-diffusion language model ({family}) trained from scratch on the "
           "testbed's synthetic reasoning tasks. It exists so that every sampler of "
           "asynclane-jax can be run and compared on a real workload on a CPU; it goes "
           "through the same loading path as a converted 8B checkpoint: "
           f"`asynclane_jax.load(\"{name}\")`.", "",
           "## Task", "",
           "Two families, alternating in the held-out split (`asynclane_jax.testbed.tasks`); "
           "every number 0..99, word, label and newline is one token:", "",
           "```",
           "math   <|user|> ann has 7 coins . (1) finds 3 (2) loses 5 (3) buys 4 . "
           "how many coins ? <|assistant|>",
           "       (1) 7 + 3 = 10 \\n (2) 10 - 5 = 5 \\n (3) 5 + 4 = 9 \\n answer : 9 "
           "<|endoftext|> ...",
           "code   <|user|> x = 4 y = 7 (1) x = y + 3 (2) y = x - 5 print y <|assistant|>",
           "       (0) x = 4 y = 7 \\n (1) 7 + 3 = 10 x = 10 y = 7 \\n "
           "(2) 10 - 5 = 5 x = 10 y = 5 \\n answer : 5 <|endoftext|> ...",
           "```", "",
           f"Math problems have {tasks.MATH_STEPS[0]}–{tasks.MATH_STEPS[1]} events, programs "
           f"{tasks.CODE_STEPS[0]}–{tasks.CODE_STEPS[1]} statements; values stay in "
           f"0..{tasks.MAX_VALUE}, operands 1..{tasks.MAX_OPERAND}. Responses are 4–8 "
           "newline-separated lines (25–63 tokens); the rest of the canvas is end-of-text. "
           "An answer is correct when the last line before end-of-text is exactly "
           "`answer : N` (`asynclane_jax.testbed.check`). The held-out split has its own "
           f"seed and the training stream skips its first {tasks.HELDOUT_POOL} prompts.", "",
           "## Model", "",
           "| field | value |", "|---|---|",
           f"| parameters | {log['params']:,} (float32) |",
           f"| layers × width | {m['n_layers']} × {m['d_model']} |",
           f"| heads (query / key-value) × head dim | {m['n_heads']} / {m['n_kv_heads']} × "
           f"{m['head_dim']} |",
           f"| MLP (SwiGLU) hidden | {m['mlp_hidden']} |",
           f"| vocabulary | {m['vocab_size']} (mask {m['mask_token_id']}, "
           f"eos = pad {m['eos_token_id']}) |",
           f"| max sequence length | {m['max_seq_len']} |", "",
           "## Training", "",
           "Masked diffusion (LLaDA's objective: t ~ U(ε, 1], each response token masked "
           "with probability t, cross-entropy on masked tokens weighted 1/t, the response "
           "region padded with end-of-text to its end), AdamW "
           f"(lr {tc['lr']}, warmup {tc['warmup_steps']} steps, cosine over the wall-clock "
           f"budget to {tc['min_lr_ratio']}×, b2 {tc['b2']}, weight decay "
           f"{tc['weight_decay']}, clip {tc['clip_norm']}). Batch shapes (response region, "
           "rows, probability): " + ", ".join(f"{r[0]}×{r[1]} ({r[2]})" for r in tc["regions"])
           + f"; prompts left-padded to {tc['prompt_length']}.", "",
           f"Steps: {log['step']:,}; training time: {minutes:.1f} min of training steps "
           "(monitoring excluded) on a shared 2-core CPU (one thread per run, two runs and "
           "other jobs in parallel). "
           "Command: `python experiments/train_testbed.py --model "
           f"{name} --minutes {tc['minutes']:g} --d-model {tc['d_model']} "
           f"--mlp-hidden {tc['mlp_hidden']}`. Loss curve: "
           f"`experiments/results/testbed_{name}.png`.", "",
           "## Held-out accuracy", "",
           "| sampler | gen length | problems | exact answer | math | code | lines exact | "
           "model calls / token | tokens/s |",
           "|---|---|---|---|---|---|---|---|---|"]
    for e in evals:
        opts = ", ".join(f"{k}={v}" for k, v in (e.get("options") or {}).items())
        label = e["sampler"] + (f" ({opts})" if opts else "")
        out.append(
            f"| {label} | {e['gen_length']} | {e['n']} | {_pct(e['accuracy'])} | "
            f"{_pct(e.get('accuracy_math'))} | {_pct(e.get('accuracy_code'))} | "
            f"{_pct(e.get('line_accuracy'))} | {e['nfe_per_token']:.2f} | {e['tps']:.0f} |")
    out += ["", "Vanilla: steps = gen_length, one token per step, block length 32, "
            "low-confidence remasking, greedy. Model calls per token count a row's model "
            "calls over its tokens before end-of-text.", ""]
    mon = log.get("evals") or []
    if mon:
        out += ["Monitored during training (vanilla, gen length "
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


def write(folder, log_path, eval_paths, attempts=None, notes: str = "") -> pathlib.Path:
    """Writes README.md into a shipped model folder from JSON logs."""
    folder = pathlib.Path(folder)
    config = json.loads((folder / "config.json").read_text())
    log = json.loads(pathlib.Path(log_path).read_text())
    evals = [json.loads(pathlib.Path(p).read_text()) for p in eval_paths]
    text = render(folder.name, config, log, evals, attempts, notes)
    (folder / "README.md").write_text(text)
    return folder / "README.md"
