"""Converted folders carry a digest per array (digests.json) that loading checks:
flipped bytes are refused by `load`, on a mesh, and by `asynclane-jax verify`; the
shipped models and the converter's output pass. Helpers: tests/hostile.py.
"""

from __future__ import annotations

import json
import pathlib
import random

import numpy as np
import pytest
from hostile import SHIPPED, _one_parser, cli, one_parser, refused  # noqa: F401
from hostile import converted_copy as _converted_copy

import asynclane_jax
from asynclane_jax import checkpoint
from asynclane_jax.checkpoint import CheckpointError

# --------------------------------------------------------------------------- integrity

def _flip(folder: pathlib.Path, n: int = 100, seed: int = 0) -> None:
    data_files = [p for p in (folder / "params").rglob("*") if p.is_file()
                  and p.parent.name == "d"]
    target = max(data_files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    for i in random.Random(seed).sample(range(len(data)), n):
        data[i] ^= 0xFF
    target.write_bytes(bytes(data))


@pytest.fixture
def corrupt(tmp_path):
    folder = _converted_copy(tmp_path)
    _flip(folder)
    return folder


def test_flipped_bytes_are_refused_by_load(corrupt, capsys, monkeypatch):
    with pytest.raises(CheckpointError, match=r"is corrupt: parameter layers\.\d+\.\S+ differs"):
        asynclane_jax.load(corrupt)
    refused(capsys, "generate", "hello", "--model", corrupt, needle="is corrupt: parameter",
            fast=False)
    asynclane_jax.load(corrupt, verify=False)  # the opt-outs: unchecked, as before
    monkeypatch.setenv(checkpoint.VERIFY_ENV, "0")
    asynclane_jax.load(corrupt)


def test_flipped_bytes_on_a_mesh(corrupt):
    import jax

    from asynclane_jax import sharding

    mesh = sharding.make_mesh("tensor", devices=jax.devices()[:1])
    with pytest.raises(CheckpointError, match="is corrupt"):
        asynclane_jax.load(corrupt, mesh=mesh)


def test_verify_command(corrupt, capsys):
    rc, out, err, _ = cli(capsys, "verify", "tiny-llada")
    assert rc == 0 and out.startswith("OK: ") and "75 arrays match" in out, err
    err = refused(capsys, "verify", corrupt, needle="is corrupt: parameters", fast=False)
    assert "differ from the digest" in err


def test_shipped_models_have_digests_and_pass():
    assert {"tiny-llada", "tiny-llada-v4b", "tiny-dream-v4", "tiny-llada-d2f"} <= set(SHIPPED)
    import jax
    from flax import nnx

    from asynclane_jax.models import abstract_model

    for name in SHIPPED:
        folder = checkpoint.resolve(name)
        assert (folder / checkpoint.DIGESTS_FILE).is_file(), name
        # Every parameter array of the model's architecture is verified (75 in the dense
        # testbed models, 82 in the mixture-of-experts tiny-llada2-v4).
        cfg, _ = checkpoint.read_config(folder)
        arrays = len(jax.tree_util.tree_leaves(nnx.state(abstract_model(cfg), nnx.Param)))
        assert checkpoint.verify_folder(name) == arrays, name


def test_converter_records_the_digest_of_every_stored_array(src, tmp_path, capsys):
    rc, _, err, _ = cli(capsys, "convert", src, tmp_path / "dst", "--no-progress")
    assert rc == 0, err
    digests = checkpoint.read_digests(tmp_path / "dst")
    model, _, _ = asynclane_jax.load(tmp_path / "dst")
    params = checkpoint.flat_arrays(checkpoint.params_to_numpy(model))
    assert set(digests) == set(params)
    for name, a in params.items():
        assert digests[name] == checkpoint.digest_entry(a), name
    assert cli(capsys, "verify", tmp_path / "dst")[0] == 0


def test_digest_listing_must_match(tmp_path, capsys):
    folder = _converted_copy(tmp_path)
    path = folder / checkpoint.DIGESTS_FILE
    data = json.loads(path.read_text())
    data["arrays"].pop("embed")
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="embed is stored but has no digest"):
        asynclane_jax.load(folder)
    path.write_text("{not json")
    refused(capsys, "verify", folder, needle="digests.json is unreadable")


def test_folder_without_digests_loads_but_cannot_be_verified(tmp_path, capsys):
    folder = _converted_copy(tmp_path)
    (folder / checkpoint.DIGESTS_FILE).unlink()
    asynclane_jax.load(folder)
    refused(capsys, "verify", folder, needle="has no digests.json")


def test_digest_of_a_large_array_is_chunked():
    a = np.arange(checkpoint.DIGEST_CHUNK // 4 + 3, dtype=np.float32)
    raw = a.tobytes()
    import hashlib

    pieces = [raw[i:i + checkpoint.DIGEST_CHUNK]
              for i in range(0, len(raw), checkpoint.DIGEST_CHUNK)]
    want = hashlib.sha256(b"".join(hashlib.sha256(p).digest() for p in pieces)).hexdigest()
    assert len(pieces) == 2 and checkpoint.array_digest(a) == want
