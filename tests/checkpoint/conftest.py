"""Fixtures of the checkpoint tests."""

import pytest
from hostile import snapshot


@pytest.fixture
def src(tmp_path):
    """A random tiny LLaDA snapshot (safetensors, Hugging Face layout)."""
    return snapshot(tmp_path)[0]
