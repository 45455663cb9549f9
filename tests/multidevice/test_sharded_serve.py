"""The serving engine on a model loaded onto a 2x4 mesh of fake CPU devices: requests
get the same tokens as `generate` on that mesh."""

from __future__ import annotations

import threading

import asynclane_jax
from asynclane_jax.decoding import generate
from asynclane_jax.serve.engine import Engine
from asynclane_jax.testbed import evaluate, tasks


def test_engine_on_a_mesh_gives_generates_tokens():
    model, tok, _ = asynclane_jax.load("tiny-llada", mesh="data=2,tensor=4")
    prompts = evaluate.prompts_for(tasks.heldout(3))
    eng = Engine(model, tok, model_name="tiny-llada", slots=2, gen_lengths=(64,), chunk=4,
                 max_prompt=64)
    eng.start()
    got = []
    try:
        for p in prompts:
            tokens, done = [], threading.Event()

            def on_update(u, tokens=tokens, done=done):
                tokens.extend(u.token_ids)
                if u.finished:
                    done.set()

            eng.submit(p, max_tokens=64, on_update=on_update)
            got.append((tokens, done))
        assert all(done.wait(300) for _, done in got)
    finally:
        eng.shutdown()
    stop = set(model.cfg.stop_token_ids)
    for p, (tokens, _) in zip(prompts, got):
        row = generate(model, [p], gen_length=64).tokens[0].tolist()
        cut = next((j for j, t in enumerate(row) if t in stop), len(row))
        assert tokens == row[:cut]
