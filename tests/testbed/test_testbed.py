"""The testbed: tasks, tokenizer, trainer, and the shipped tiny models."""

import dataclasses
import pathlib
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from asynclane_jax.testbed import tasks, train
from asynclane_jax.testbed import tokenizer as tok


def test_problems_are_deterministic_and_checkable():
    a, b = tasks.heldout(40), tasks.heldout(40)
    assert a == b
    assert {p.family for p in a} == set(tasks.FAMILIES)
    for fam in tasks.FAMILIES:
        # One prompt length per family: a line's statement sits at a fixed distance.
        assert len({len(tok.prompt_ids(p.prompt)) for p in a if p.family == fam}) == 1
    for p in a:
        ids = tok.encode(p.response) + [tok.special_ids()["eos_token_id"]] * 5
        assert tasks.check(p, ids)
        assert tasks.check(p, p.response)
        assert tasks.line_accuracy(p, ids) == (len(p.lines), len(p.lines))
        assert len(p.lines) >= 4  # several working lines, then the answer line
        wrong = p.response.rsplit(":", 1)[0] + f": {(p.answer + 1) % 20}"
        assert not tasks.check(p, wrong)
        assert not tasks.check(p, "")


def test_working_lines_are_consistent():
    rng = random.Random(1)
    for _ in range(200):
        p = tasks.make_problem(rng)
        for line in p.lines[:-1]:
            w = line.split()
            if "+" in w or "-" in w:
                i = w.index("+") if "+" in w else w.index("-")
                a, c, r = int(w[i - 1]), int(w[i + 1]), int(w[i + 3])
                assert r == (a + c if w[i] == "+" else a - c)
                assert 0 <= r <= tasks.MAX_VALUE


def test_heldout_is_never_in_the_training_stream():
    held = {p.prompt for p in tasks.heldout(tasks.HELDOUT_POOL)}
    stream = tasks.problem_stream()
    assert not any(next(stream).prompt in held for _ in range(3000))


def test_hf_tokenizer_matches_builtin_encoder(tmp_path):
    from transformers import PreTrainedTokenizerFast

    tok.save_tokenizer(tmp_path)
    hf = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert isinstance(hf, PreTrainedTokenizerFast)
    assert hf.convert_tokens_to_ids(hf.mask_token) == tok.special_ids()["mask_token_id"]
    assert hf.eos_token_id == hf.pad_token_id == tok.special_ids()["eos_token_id"]
    for p in tasks.heldout(10):
        text = f"{tok.USER} {p.prompt} {tok.ASSISTANT}"
        assert hf.encode(text, add_special_tokens=False) == tok.prompt_ids(p.prompt)
        assert hf.encode(p.response, add_special_tokens=False) == tok.encode(p.response)
        assert tasks.check(p, hf.decode(tok.encode(p.response)))
    chat = hf.apply_chat_template([{"role": "user", "content": "x = 1 y = 2 print x"}],
                                  add_generation_prompt=True, tokenize=False)
    assert chat.startswith(tok.USER) and chat.endswith(tok.ASSISTANT)


def _tiny(family):
    make = train.llada_config if family == "llada" else train.dream_config
    return make(d_model=32, n_layers=2, head_dim=8, mlp_hidden=64, n_kv_heads=2,
                regions=((64, 8, 1.0),), lr=3e-3, warmup_steps=1, steps=100, minutes=None,
                eval_every_s=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_few_training_steps_lower_the_loss(family):
    tc = _tiny(family)
    trainer = train.Trainer(tc)
    assert trainer.cfg.logit_shift == (family == "dream")
    assert trainer.cfg.qkv_bias == (family == "dream")
    probe = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}
    key = jax.random.key(42)

    def probe_loss():
        model = nnx.merge(trainer.graphdef, trainer.params)
        return float(train.diffusion_loss(model, probe, key)[0])

    before = probe_loss()
    for _ in range(12):
        trainer.train_step()
    assert probe_loss() < 0.8 * before


def test_a_run_folder_reopens_at_its_last_checkpoint(tmp_path):
    """TrainConfig.from_dict reads what to_dict wrote (tuples and all; unknown keys
    refused), and Trainer.from_run reopens a run folder at its last checkpoint with the
    weights as trained (a warm start is not applied again)."""
    v2 = train.v2_config("llada", bucket_policy="fits", lines_curriculum=(4, 0.2, 0.6),
                         shuffle_statements=0.5, init_from="tiny-llada")
    assert train.TrainConfig.from_dict(v2.to_dict()) == v2
    with pytest.raises(ValueError, match="unknown fields colour"):
        train.TrainConfig.from_dict({**v2.to_dict(), "colour": "red"})
    trainer = train.Trainer(_tiny("llada"), tmp_path / "run")
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint()
    back = train.Trainer.from_run(tmp_path / "run")
    assert back.step == 2 and back.tc == trainer.tc
    for a, b in zip(jax.tree.leaves(trainer.params), jax.tree.leaves(back.params)):
        np.testing.assert_array_equal(a, b)


def test_batches_put_eos_after_the_answer():
    stream = tasks.problem_stream()
    tc = train.TrainConfig()
    batch = train.make_batch(stream, 4, 64, tc.prompt_length, np.random.default_rng(0))
    eos = tok.special_ids()["eos_token_id"]
    for row, resp in zip(batch["tokens"], batch["response"]):
        text = tok.decode_ids(row[resp])
        assert "answer :" in text and row[-1] == eos
        assert not resp[:tc.prompt_length].any() and resp[tc.prompt_length:].all()


def test_mask_ratio_curriculum():
    tc = dataclasses.replace(_tiny("llada"), t_max_start=0.2, t_ramp=0.5)
    assert train.t_max_at(tc, 0.0) == pytest.approx(0.2)
    assert train.t_max_at(tc, 0.25) == pytest.approx(0.6)
    assert train.t_max_at(tc, 0.5) == train.t_max_at(tc, 0.9) == 1.0
    assert train.t_max_at(dataclasses.replace(tc, t_ramp=0.0), 0.0) == 1.0  # off
    trainer = train.Trainer(tc)
    batch = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}
    model = nnx.merge(trainer.graphdef, trainer.params)
    fracs = {t_max: np.mean([float(train.diffusion_loss(
        model, batch, jax.random.key(s), t_max=t_max)[1]["mask_frac"]) for s in range(4)])
        for t_max in (0.2, 1.0)}
    # t ~ U(0, t_max]: on average t_max / 2 of the response is masked.
    assert 0.03 < fracs[0.2] < 0.2 and 0.3 < fracs[1.0] < 0.7
    rec = trainer.train_step()
    assert rec["t_max"] == pytest.approx(0.2) and rec["mask_frac"] < 0.35


def test_loss_ignores_unmasked_positions():
    tc = _tiny("dream")
    trainer = train.Trainer(dataclasses.replace(tc, seed=3))
    batch = {k: jnp.asarray(v) for k, v in trainer.next_batch().items()}
    empty = dict(batch, response=jnp.zeros_like(batch["response"]).at[:, -1].set(True))
    model = nnx.merge(trainer.graphdef, trainer.params)
    loss, _ = train.diffusion_loss(model, empty, jax.random.key(0), t_eps=1.0)
    assert np.isfinite(float(loss)) and float(loss) > 0


MIN_SOLVED = 12  # of 20 held-out problems (guessing gets about 2: answers are 0..9)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada", "tiny-dream"])
def test_shipped_model_loads_and_solves_heldout_problems(name):
    """The shipped models load by name through the converted-folder path, write
    well-formed solutions (one working line per step with the right labels, then
    "answer : N", then end-of-text), and solve at least 12 of the first 20 held-out
    problems with the vanilla sampler at gen length 64 (measured: tiny-llada 16,
    tiny-dream 15; the full evaluation is in each model card)."""
    import re

    from asynclane_jax import generate, load, shipped_models
    from asynclane_jax.testbed.evaluate import prompts_for

    assert name in shipped_models()
    model, tokenizer, cfg = load(name)
    assert cfg.family == name.split("-")[1]
    assert tokenizer is not None and tokenizer.mask_token == tok.MASK
    problems = tasks.heldout(20)
    res = generate(model, prompts_for(problems, tokenizer), sampler="vanilla",
                   gen_length=64, block_length=32, steps=64)
    well_formed = solved = 0
    for p, row in zip(problems, res.tokens):
        lines = tasks.parse_lines(tasks.response_text(tok.decode_tokens(row)))
        labels = [ln.split()[0] for ln in lines[:-1]]
        ref_labels = [ln.split()[0] for ln in p.lines[:-1]]
        if labels == ref_labels and re.fullmatch(r"answer : \d+", lines[-1] if lines else ""):
            well_formed += 1
        solved += tasks.check(p, row)
    assert well_formed >= 16, f"{well_formed} of 20 well-formed"
    assert solved >= MIN_SOLVED, f"{solved} of 20 solved"


def test_a_warm_start_takes_the_source_weights_and_keeps_the_new_ids():
    """A v2 run started from tiny-llada (vocabulary 159 -> 194): every array is the
    source's, the embedding rows and output-head columns of the new ids keep the fresh
    initialisation; another architecture is refused, naming the array."""
    from asynclane_jax import checkpoint

    arch = train.source_architecture("tiny-llada")
    assert arch["family"] == "llada"
    arch.pop("family")
    tc = train.v2_config("llada", **arch)
    fresh = nnx.split(train.DiffusionLM(tc.model_config(), rngs=nnx.Rngs(0)))[1]
    warm = train.warm_start_params(fresh, "tiny-llada")
    source = nnx.split(checkpoint.load_model(checkpoint.resolve("tiny-llada")))[1]
    old = source["embed"].get_value().shape[0]
    assert old < tok.vocab_size() == warm["embed"].get_value().shape[0]
    np.testing.assert_array_equal(warm["embed"].get_value()[:old], source["embed"].get_value())
    np.testing.assert_array_equal(warm["embed"].get_value()[old:], fresh["embed"].get_value()[old:])
    head = warm["lm_head"]["kernel"].get_value()
    np.testing.assert_array_equal(head[:, :old], source["lm_head"]["kernel"].get_value())
    np.testing.assert_array_equal(head[:, old:], fresh["lm_head"]["kernel"].get_value()[:, old:])
    up = [t["layers"][3]["mlp"]["up_proj"]["kernel"].get_value() for t in (warm, source)]
    np.testing.assert_array_equal(*up)

    narrow = dataclasses.replace(tc, mlp_hidden=128)
    other = nnx.split(train.DiffusionLM(narrow.model_config(), rngs=nnx.Rngs(0)))[1]
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj\.kernel has "
                       r"shape \(256, 64\), the new model \(128, 64\)"):
        train.warm_start_params(other, "tiny-llada")


def test_the_card_names_the_command_that_trains_the_run():
    from asynclane_jax.testbed import card

    v1 = train.llada_config(qkv_bias=True).to_dict()
    assert card.train_command(v1) == (
        "python experiments/train_testbed.py --model tiny-llada --minutes 55 --d-model 64 "
        "--mlp-hidden 256 --qkv-bias --t-max-start 0.25 --t-ramp 0.2 --long-frac 0.08")
    warm = train.v2_config("dream", init_from="tiny-dream", minutes=72.0, t_ramp=0.1).to_dict()
    assert card.train_command(warm) == (
        "python experiments/train_testbed.py --model tiny-dream --minutes 72 --init-from "
        "tiny-dream --t-max-start 0.25 --t-ramp 0.1 --task-set v2")
    staged = train.v2_config("llada", bucket_policy="fits", lines_curriculum=(4, 0.45, 0.8))
    assert card.train_command(staged.to_dict()).endswith(
        "--task-set v2 --bucket-policy fits --lines-curriculum 4,0.45,0.8")
    named = train.v2_config("llada", name="tiny-llada-v2s", shuffle_statements=0.5).to_dict()
    command = card.train_command(named)
    assert "--minutes 55 --name tiny-llada-v2s " in command
    assert command.endswith("--task-set v2 --shuffle-statements 0.5")
    v3 = train.v3_config("llada", init_from="tiny-llada-v2", minutes=32.0).to_dict()
    assert card.train_command(v3) == (
        "python experiments/train_testbed.py --model tiny-llada --minutes 32 --init-from "
        "tiny-llada-v2 --t-max-start 0.25 --t-ramp 0.2 --task-set v3")
    mixed = train.v4_config("llada", name="tiny-llada-v4b", init_from="tiny-llada-v4",
                            lr=1e-3, family_weights=(1.0, 1.0, 3.0, 3.0)).to_dict()
    assert card.train_command(mixed) == (
        "python experiments/train_testbed.py --model tiny-llada --minutes 55 --name "
        "tiny-llada-v4b --lr 0.001 --init-from tiny-llada-v4 --t-max-start 0.25 --t-ramp 0.2 "
        "--task-set v4 --family-weights 1,1,3,3")
    assert "walk-down 37.5%" in card._curriculum(mixed)
    ar = train.ar_v4_config(minutes=85.0, qkv_bias=True,
                            family_weights=(1.0, 1.0, 3.0, 3.0)).to_dict()
    assert card.train_command(ar) == (
        "python experiments/train_testbed.py --model tiny-llada --objective causal "
        "--minutes 85 --d-model 64 --mlp-hidden 256 --qkv-bias --task-set v4 "
        "--family-weights 1,1,3,3")
    assert train.TrainConfig.from_dict(mixed).family_weights == (1.0, 1.0, 3.0, 3.0)


def test_family_weights_set_the_mix_of_the_training_stream():
    import collections
    import itertools

    uniform = [p.prompt for p in itertools.islice(tasks.problem_stream(families="v4"), 50)]
    assert uniform == [p.prompt for p in tasks.split("train", 50, "v4")]
    stream = tasks.problem_stream(families="v4", weights=(1, 0, 3, 4))
    counts = collections.Counter(p.family for p in itertools.islice(stream, 4000))
    assert counts["code"] == 0
    for family, share in (("math", 1 / 8), ("walk-down", 3 / 8), ("table-down", 4 / 8)):
        assert abs(counts[family] / 4000 - share) < 0.03, (family, counts)
    held = {p.prompt for p in tasks.heldout(tasks.HELDOUT_POOL, "v4")}
    assert not held & {p.prompt for p in itertools.islice(stream, 2000)}
    for bad in ((1, 1, 1), (1, -1, 1, 1), (0, 0, 0, 0)):
        with pytest.raises(ValueError, match="expected 4 weights"):
            next(tasks.problem_stream(families="v4", weights=bad))


@pytest.mark.parametrize("name", ["tiny-llada-v4b", "tiny-dream-v4"])
def test_the_v4_cards_describe_walk_down_and_table_down_from_the_split(name):
    """A shipped v4 card's task section is rendered from the task set (its examples
    and statistics computed), not typed."""
    from asynclane_jax.testbed import card

    section = card.TASK_SECTIONS["v4"](tasks.split("train", 200, "v4"))
    text = "\n".join(section)
    stats = tasks.split_stats(tasks.heldout(1000, "v4"))
    assert "| walk-down |" in text and "| table-down |" in text and "| walk |" not in text
    assert f"{100 * stats['frac_over_128']:.1f}% of answers are longer than 128" in text
    shipped = (pathlib.Path(tasks.__file__).parent / "models" / name / "README.md").read_text()
    assert text in shipped


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada-v4b", "tiny-dream-v4"])
def test_the_v4_models_solve_the_short_families(name):
    """tiny-llada-v4b and tiny-dream-v4 load by name with the vocabulary the tokenizer
    grew to, and still solve math and code (the families of the first models) with
    Fast-dLLM at gen length 256: at least 14 of the first 16 such held-out problems."""
    from asynclane_jax import generate, load
    from asynclane_jax.testbed.evaluate import prompts_for

    model, tokenizer, cfg = load(name)
    assert cfg.vocab_size == len(tokenizer) <= tok.vocab_size()  # words came at the end
    problems = [p for p in tasks.heldout(32, "v4") if p.family in ("math", "code")]
    assert len(problems) == 16
    res = generate(model, prompts_for(problems, tokenizer), sampler="fast-dllm",
                   gen_length=256, cache="dual", tokenizer=tokenizer)
    solved = sum(tasks.check(p, row) for p, row in zip(problems, res.tokens))
    assert solved >= 14, solved


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llada-v4b", "tiny-dream-v4"])
def test_the_v4b_models_solve_long_answers_with_the_default_sampler(name):
    """tiny-llada-v4b (LLaDA-style) and tiny-dream-v4 (Dream-style) record the task set
    v4 and, with AsyncLane at its defaults (forking, full forwards) at gen length 512,
    solve at least 12 of the first 16 held-out walk-down and table-down problems,
    answers of 25 to 377 tokens (their cards and the bench report 500 problems)."""
    from asynclane_jax import generate, load
    from asynclane_jax.testbed.evaluate import prompts_for

    model, tokenizer, cfg = load(name)
    assert tasks.model_task_set(name) == "v4"
    assert cfg.family == ("llada" if "llada" in name else "dream")
    problems = [p for p in tasks.heldout(32, "v4") if p.family in ("walk-down", "table-down")]
    assert len(problems) == 16
    res = generate(model, prompts_for(problems, tokenizer), sampler="asynclane",
                   gen_length=512, tokenizer=tokenizer)
    assert np.all(res.stats.forks >= 1)  # every answer has several lines: the lanes fork
    solved = sum(tasks.check(p, row) for p, row in zip(problems, res.tokens))
    assert solved >= 12, solved
