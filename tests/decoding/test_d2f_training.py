"""The D2F students' training states (experiments/train_d2f.py): decode-time states of
pipelined decoding (`decode_state_ratios`), the answer's blocks, and the loss on them."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "train_d2f.py"


@pytest.fixture(scope="module")
def train_d2f():
    spec = importlib.util.spec_from_file_location("train_d2f_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_answer_blocks_counts_the_blocks_up_to_the_first_end_of_text(train_d2f):
    E, P, B = 0, 2, 4
    tokens = np.full((4, P + 16), E, np.int32)
    tokens[:, :P] = 7
    tokens[0, P:P + 3] = 5      # answer in block 0, its end-of-text there too
    tokens[1, P:P + 4] = 5      # answer fills block 0, end-of-text opens block 1
    tokens[2, P:P + 13] = 5     # end-of-text in block 3
    tokens[3, P:] = 5           # no end-of-text: every block
    got = train_d2f.answer_blocks(jnp.asarray(tokens), P, B, E)
    assert np.asarray(got).tolist() == [1, 2, 4, 4]


def test_decode_states_are_clean_then_rising_then_fully_masked(train_d2f):
    nb, n = 16, 4000
    answer = jnp.asarray(np.random.default_rng(0).integers(1, nb + 1, n), jnp.int32)
    r, queried = train_d2f.decode_state_ratios(jax.random.key(1), answer, nb, t_eps=0.05,
                                               p_decode=1.0, in_flight=4)
    r, queried = np.asarray(r), np.asarray(queried)
    assert r.shape == queried.shape == (n, nb)
    for row, q, a in zip(r, queried, np.asarray(answer)):
        clean = np.nonzero(row == 0.0)[0]
        full = np.nonzero(row == 1.0)[0]
        window = np.nonzero((row > 0.0) & (row < 1.0))[0]
        f = len(clean)
        assert clean.tolist() == list(range(f)) and f < a  # first in-flight block in the answer
        assert window.tolist() == list(range(f, f + len(window)))
        assert 1 <= len(window) <= 4
        assert np.all(np.diff(row[window]) >= 0) and np.all(row[window] >= 0.05)
        assert full.tolist() == list(range(f + len(window), nb))
        # The loss reads the window only (the blocks before it have no masks).
        assert np.nonzero(q)[0].tolist() == list(range(f + len(window)))
    # The first in-flight block's own ratio is uniform in [t_eps, 1]: decoding takes
    # every block, the first ones of a long answer too, from fully masked down.
    f_all = (r == 0.0).sum(axis=1)
    own = r[np.arange(n), f_all]
    assert abs(np.mean(own >= 0.5) - 0.5 / 0.95) < 0.05
    # The first in-flight block is uniform over the answer's blocks: a late block of a
    # long answer comes as often as an early one, with everything before it clean.
    long = np.asarray(answer) == nb
    first = (r[long] == 0.0).sum(axis=1)
    counts = np.bincount(first, minlength=nb)
    assert counts.min() > 0.5 * counts.mean()


def test_p_decode_zero_is_the_sorted_draw(train_d2f):
    answer = jnp.full((500,), 16, jnp.int32)
    r, queried = train_d2f.decode_state_ratios(jax.random.key(2), answer, 16, t_eps=0.05,
                                               p_decode=0.0, in_flight=4)
    r = np.asarray(r)
    assert np.all(np.diff(r, axis=1) >= 0) and r.min() >= 0.05 and r.max() < 1.0
    assert np.all(np.asarray(queried))
    mixed = np.asarray(train_d2f.decode_state_ratios(jax.random.key(2), answer, 16,
                                                     t_eps=0.05, p_decode=0.5,
                                                     in_flight=4)[0])
    share = np.mean(np.any(mixed == 1.0, axis=1) | np.any(mixed == 0.0, axis=1))
    assert 0.4 < share < 0.6


def test_decode_state_loss_is_finite_with_clean_and_fully_masked_blocks(train_d2f):
    from asynclane_jax.models import init_model, tiny_llada

    cfg = tiny_llada()
    teacher = init_model(cfg, 0)
    student = init_model(cfg.replace(block_causal=True), 0)
    P, B, G = 4, 8, 32
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size - 2, (3, P + G)).astype(np.int32)
    tokens[0, P + 12:] = cfg.eos_token_id
    batch = {"tokens": jnp.asarray(tokens), "key_mask": jnp.ones((3, P + G), bool),
             "response": jnp.asarray(np.arange(P + G)[None, :].repeat(3, 0) >= P)}
    kw = dict(block_length=B, prompt_length=P, t_eps=0.05)
    for p_decode in (1.0, 0.0):
        loss, aux = train_d2f.decode_state_loss(student, teacher, batch, jax.random.key(3),
                                                p_decode=p_decode, in_flight=2, **kw)
        assert np.isfinite(float(loss)) and float(loss) > 0
        assert all(np.isfinite(float(v)) for v in aux.values())
