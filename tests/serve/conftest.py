"""Fixtures the serve tests share: the test model and its tokenizer, loaded once per
module that asks for them."""

from __future__ import annotations

import pytest
from serve_fakes import MODEL

import asynclane_jax


@pytest.fixture(scope="module")
def loaded():
    return asynclane_jax.load(MODEL)


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded[1]
