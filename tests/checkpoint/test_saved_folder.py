"""A converted folder names no path of the machine that wrote it."""

from __future__ import annotations

import pathlib

from asynclane_jax import checkpoint
from asynclane_jax.models.config import ModelConfig
from asynclane_jax.models.model import init_model


def _files(folder: pathlib.Path):
    return [p for p in folder.rglob("*") if p.is_file()]


def test_saved_folder_holds_no_machine_path(tmp_path):
    cfg = ModelConfig(family="llada", vocab_size=32, d_model=16, n_layers=1, n_heads=2,
                      n_kv_heads=2, head_dim=8, mlp_hidden=32, max_seq_len=64,
                      mask_token_id=1, eos_token_id=0, pad_token_id=0)
    dst = checkpoint.save(tmp_path / "m", init_model(cfg))
    marker = dst / checkpoint.PARAMS_DIR / checkpoint.COMMIT_MARKER
    assert marker.read_text() == checkpoint.COMMIT_MARKER_TEXT
    for f in _files(dst):
        assert str(tmp_path).encode() not in f.read_bytes(), f
    checkpoint.load(dst)  # still loads


def test_shipped_folders_hold_no_machine_path():
    for folder in checkpoint.shipped_registry().values():
        for f in _files(folder):
            assert b"successful to /" not in f.read_bytes(), f
