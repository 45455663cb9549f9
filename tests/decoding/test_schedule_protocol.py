"""The schedule protocol around the samplers: the registry (one class per name, options
whose types differ by sampler), operands passed into the compiled program, the
trace-time checks that name a schedule returning a wrong shape, and the bounded cache
of compiled programs."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from reference_samplers import make_model, make_prompts

from asynclane_jax.cli import main
from asynclane_jax.decoding import driver, generate, registry
from asynclane_jax.decoding.ops import greedy_confidence
from asynclane_jax.decoding.schedule import Plan, SamplerError, Schedule
from asynclane_jax.decoding.vanilla import VanillaSchedule

GEN = 8


@pytest.fixture
def unregister():
    """Classes a test registers are unregistered after it (their `name` cleared), so
    the registry is as before whenever they are garbage-collected."""
    made = []
    yield made.append
    for cls in made:
        cls.name = None
    registry.samplers()  # raises if a test class still holds a name


def test_a_second_class_under_a_taken_name_is_an_error(unregister):
    @dataclasses.dataclass(frozen=True)
    class Impostor(VanillaSchedule):
        name = "vanilla"

    unregister(Impostor)
    with pytest.raises(SamplerError, match="registered twice") as err:
        registry.samplers()
    assert "VanillaSchedule" in str(err.value) and "Impostor" in str(err.value)


def test_two_samplers_may_give_one_option_name_different_types(unregister, capsys):
    @dataclasses.dataclass(frozen=True)
    class Worded(VanillaSchedule):
        """A test sampler whose threshold is a word.

        Attributes:
          threshold: a word, not a probability.
        """

        name = "test-worded"
        threshold: str = "high"

    unregister(Worded)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--sampler test-worded" in text and "a word, not a probability" in text
    assert "--sampler fast-dllm" in text
    # Each sampler reads the same flag with its own type.
    assert registry.convert_option(Worded, "threshold", "low") == "low"
    fast = registry.get_schedule_class("fast-dllm")
    assert registry.convert_option(fast, "threshold", "0.5") == 0.5
    with pytest.raises(SamplerError, match="is not a float"):
        registry.convert_option(fast, "threshold", "low")
    with pytest.raises(SamplerError, match="not an option of vanilla.*asynclane"):
        registry.convert_option(VanillaSchedule, "refine_window", "3")


def test_cli_reads_an_option_as_the_chosen_samplers_type(capsys):
    rc = main(["generate", "--sampler", "vanilla", "--block-length", "many", "x"])
    assert rc == 2 and "'many' is not an int" in capsys.readouterr().err
    rc = main(["generate", "--sampler", "vanilla", "--refine-window", "3", "x"])
    assert rc == 2 and "--refine-window is not an option of vanilla" in capsys.readouterr().err


@dataclasses.dataclass(frozen=True)
class Biased(Schedule):
    """Left to right, one column per step, the argmax of the logits plus a bias vector
    over the vocabulary that the program takes as an operand (not a constant)."""

    bias: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def operands(self):
        return {"bias": self.bias}

    def max_iterations(self):
        return self.gen_length + 1

    def init(self, ctx):
        return jnp.zeros((ctx.batch,), jnp.int32)  # [b] next generated index

    def plan(self, ctx, canvas, state, live):
        return Plan(positions=(ctx.prompt_len + state - ctx.shift)[:, None],
                    full=jnp.asarray(True), serve=live)

    def update(self, ctx, canvas, state, out, key):
        col = (ctx.prompt_len + state)[:, None]
        logits, _ = out.at(col)
        x0, _ = greedy_confidence(logits + ctx.operands["bias"])
        rows = jnp.arange(ctx.batch)[:, None]
        return canvas.at[rows, col].set(x0), state + 1

    def done(self, ctx, canvas, state):
        return state >= self.gen_length


def test_operands_are_arguments_of_one_program():
    model = make_model("llada", lm_scale=10.0)
    prompts = make_prompts(model.cfg.vocab_size)
    V = model.cfg.vocab_size
    favour = lambda t: np.where(np.arange(V) == t, 1e4, 0.0).astype(np.float32)
    before = driver.TRACE_COUNT["decode"]
    a = generate(model, prompts, sampler=Biased(gen_length=GEN, bias=favour(3)))
    b = generate(model, prompts, sampler=Biased(gen_length=GEN, bias=favour(5)))
    assert driver.TRACE_COUNT["decode"] - before == 1 and not b.stats.compiled
    assert (a.tokens == 3).all() and (b.tokens == 5).all()
    assert "bias" not in a.stats.options
    # Another operand shape is another program.
    c = generate(model, prompts, sampler=Biased(gen_length=GEN, bias=favour(3)[None]))
    assert c.stats.compiled and (c.tokens == 3).all()


@dataclasses.dataclass(frozen=True)
class WrongServe(Biased):
    def plan(self, ctx, canvas, state, live):
        plan = super().plan(ctx, canvas, state, live)
        return plan.replace(serve=live[:, None])  # [b, 1] instead of [b]


@dataclasses.dataclass(frozen=True)
class WrongState(Biased):
    def update(self, ctx, canvas, state, out, key):
        canvas, state = super().update(ctx, canvas, state, out, key)
        return canvas, state.astype(jnp.float32)


def test_a_wrong_plan_or_state_is_named_at_trace_time():
    model = make_model("llada", lm_scale=10.0)
    prompts = make_prompts(model.cfg.vocab_size)
    bias = np.zeros(model.cfg.vocab_size, np.float32)
    with pytest.raises(AssertionError, match=r"WrongServe\.plan: Plan\.serve is \[b\]"):
        generate(model, prompts, sampler=WrongServe(gen_length=GEN, bias=bias))
    with pytest.raises(AssertionError, match=r"WrongState\.update: the state keeps init's"):
        generate(model, prompts, sampler=WrongState(gen_length=GEN, bias=bias))


def test_the_program_cache_is_bounded_and_shows_what_it_holds():
    model = make_model("llada", lm_scale=10.0)
    prompts = make_prompts(model.cfg.vocab_size)
    size = driver.PROGRAMS.maxsize
    try:
        driver.set_program_cache_size(2)
        for g in (4, 5, 6):
            generate(model, prompts, sampler="vanilla", gen_length=g, steps=g, block_length=g)
        held = driver.compiled_programs()
        assert len(held) == 2
        assert [h["schedule"].gen_length for h in held] == [5, 6]  # least recent first
        again = generate(model, prompts, sampler="vanilla", gen_length=5, steps=5,
                         block_length=5)
        assert not again.stats.compiled
        assert driver.compiled_programs()[-1]["schedule"].gen_length == 5
        assert driver.compiled_programs()[-1]["uses"] == 1
        first = generate(model, prompts, sampler="vanilla", gen_length=4, steps=4,
                         block_length=4)
        assert first.stats.compiled  # it was dropped
        with pytest.raises(SamplerError, match="at least 1"):
            driver.set_program_cache_size(0)
    finally:
        driver.set_program_cache_size(size)
