"""Hostile inputs to the converter and the loader: every bad input is one line on
stderr and exit status 2, within a second, with nothing written; SIGINT and SIGTERM
during a conversion (real signals, real processes) leave nothing behind.

Sections: config.json fields (Hugging Face and converted), safetensors headers, LoRA
settings, --verify, signals, destinations, tokenizer files, and hypothesis fuzzing of
config fields. Helpers: tests/hostile.py.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import signal
import struct
import subprocess
import sys
import time

import hf_reference as H
import numpy as np
import pytest
import torch
from hostile import (  # noqa: F401
    FAST,
    FUZZ,
    _one_parser,
    cli,
    convert_refused,
    leftovers,
    one_line,
    one_parser,
    refused,
    snapshot,
)
from hostile import converted_copy as _converted_copy
from hypothesis import given, settings
from hypothesis import strategies as st

import asynclane_jax
from asynclane_jax import checkpoint
from asynclane_jax.checkpoint import CheckpointError
from asynclane_jax.models import ConfigError, from_hf_config

# --------------------------------------------------------------------------- config.json

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("family, overrides, needle", [
    ("llada", {"n_layers": 10**9}, "n_layers=1000000000"),
    ("llada", {"n_heads": 0}, "n_heads=0"),
    ("llada", {"d_model": "abc"}, "d_model='abc'"),
    ("llada", {"rope_theta": "abc"}, "rope_theta='abc'"),
    ("llada", {"eos_token_id": []}, "eos_token_id=[]"),
    ("llada", {"d_model": 32.9}, "d_model=32.9: must be an integer"),
    ("llada", {"rope_theta": NAN}, "rope_theta=nan"),
    ("llada", {"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05"),
    ("llada", {"mlp_hidden_size": -64}, "mlp_hidden_size=-64"),
    ("llada", {"embedding_size": True}, "embedding_size=True"),
    ("llada", {"n_kv_heads": 3}, "not a multiple of n_kv_heads=3"),
    ("llada", {"d_model": 30}, "d_model=30 is not a multiple of n_heads=4"),
    ("llada", {"include_qkv_bias": "no"}, "include_qkv_bias='no'"),
    ("llada", {"max_sequence_length": 1e300}, "max_sequence_length="),
    ("llada", {"mask_token_id": 64}, "mask_token_id=64: not an id"),
    ("llada", {"architectures": 5}, "architectures=5"),
    ("dream", {"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000"),
    ("dream", {"eos_token_id": []}, "eos_token_id=[]"),
    ("dream", {"hidden_size": "abc"}, "hidden_size='abc'"),
    ("dream", {"num_attention_heads": 0}, "num_attention_heads=0"),
    ("dream", {"rope_theta": INF}, "rope_theta=inf"),
    ("dream", {"head_dim": 7}, "head_dim=7"),
    ("dream", {"vocab_size": [64]}, "vocab_size=[64]"),
])
def test_bad_hf_config_field(tmp_path, capsys, family, overrides, needle):
    """Checked field by field before any shape is built: 10^9 layers is refused at once
    (it used to build 10^9 abstract blocks, deaf to signals), 32.9 is not truncated."""
    path, hf, _ = snapshot(tmp_path, family)
    hf.update(overrides)
    (path / "config.json").write_text(json.dumps(hf))
    convert_refused(capsys, path, tmp_path / "dst", needle=needle)


def test_every_size_bound_and_parameter_count_is_checked():
    with pytest.raises(ConfigError, match="parameters: more than"):
        from_hf_config(H.llada_hf_config(d_model=2**17, n_heads=2**12, mlp_hidden_size=2**20,
                                         n_layers=1024, embedding_size=2**20))
    from asynclane_jax.models import param_stats, preset
    from asynclane_jax.models.config import n_params

    for name in ("tiny-llada-test", "tiny-dream-test"):
        for bias in (False, True):
            for tie in (False, True):
                cfg = preset(name).replace(qkv_bias=bias, tie_embeddings=tie)
                assert n_params(cfg.to_dict()) == param_stats(cfg)["params"]


@pytest.mark.parametrize("edit, needle", [
    (lambda d: d["model"].update(n_layers=10**9), "n_layers=1000000000"),
    (lambda d: d["model"].update(n_heads=0), "n_heads=0"),
    (lambda d: d["model"].update(d_model="abc"), "d_model='abc'"),
    (lambda d: d["model"].update(rope_theta=NAN), "rope_theta=nan"),
    (lambda d: d["model"].update(head_dim=16.5), "head_dim=16.5"),
    (lambda d: d["model"].update(eos_token_id=[]), "eos_token_id=[]"),
    (lambda d: d["model"].update(mask_token_id=10**6), "mask_token_id=1000000"),
    (lambda d: d["model"].update(qkv_bias="yes"), "qkv_bias='yes'"),
    (lambda d: d["model"].pop("family"), "missing model config fields ['family']"),
    (lambda d: d.update(model=[1, 2]), "not an object"),
    (lambda d: d.update(format_version=99), "format_version 99"),
])
def test_bad_converted_config_field(tmp_path, capsys, edit, needle):
    folder = _converted_copy(tmp_path)
    data = json.loads((folder / "config.json").read_text())
    edit(data)
    (folder / "config.json").write_text(json.dumps(data))
    refused(capsys, "info", "--model", folder, needle=needle)


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe{}", "not a readable JSON file"),
    (b"[1, 2]", "not an asynclane-jax config"),
    (b'{"format": "asynclane-jax", "model": {', "not a readable JSON file"),
])
def test_unreadable_converted_config(tmp_path, capsys, content, needle):
    folder = _converted_copy(tmp_path)
    (folder / "config.json").write_bytes(content)
    refused(capsys, "info", "--model", folder, needle=needle)
    refused(capsys, "generate", "hello", "--model", folder, needle=needle)


# --------------------------------------------------------------------------- safetensors

def rewrite_header(path: pathlib.Path, edit=None, raw: bytes | None = None) -> None:
    """Replaces a safetensors file's header (edited as JSON, or given raw), data kept."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    if raw is None:
        header = json.loads(data[8:8 + n])
        edit(header)
        raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _by_offset(header):
    return sorted((k for k in header if k != "__metadata__"),
                  key=lambda k: header[k]["data_offsets"][0])


def _set(name_index, key, value):
    def edit(h):
        h[_by_offset(h)[name_index]][key] = value
    return edit


def _overlap(h):
    a, b = [k for k in _by_offset(h) if k.endswith(("q_proj.weight", "k_proj.weight"))][:2]
    h[b]["data_offsets"] = h[a]["data_offsets"]


def _hole(h):
    del h[_by_offset(h)[1]]


@pytest.mark.parametrize("edit, needle", [
    (_set(0, "data_offsets", ["0", "256"]), "data_offsets ['0', '256']"),
    (_set(0, "data_offsets", [NAN, 256]), "data_offsets [nan, 256]"),
    (_set(0, "data_offsets", [0.0, 256.5]), "data_offsets [0.0, 256.5]"),
    (_set(1, "data_offsets", [512, 256]), "are not two integers 0 <= begin <= end"),
    (_set(0, "data_offsets", [0, 128, 256]), "are not two integers"),
    (_set(0, "shape", [-1, 64]), "shape [-1, 64]"),
    (_set(0, "shape", ["32"]), "shape ['32']"),
    (_set(0, "shape", 32), "shape 32"),
    (_set(0, "dtype", "F8_E4M3"), "dtype 'F8_E4M3'"),
    (_set(0, "dtype", 5), "dtype 5"),
    (_overlap, "overlap"),
    (_hole, "belong to no tensor"),
    (lambda h: h.update(__metadata__={"format": 5}), "__metadata__"),
    (lambda h: h.update(x=5), "tensor 'x': its header entry is not an object"),
])
def test_bad_safetensors_header(src, tmp_path, capsys, edit, needle):
    rewrite_header(src / "model.safetensors", edit)
    convert_refused(capsys, src, tmp_path / "dst", needle=needle)


@pytest.mark.parametrize("mutate, needle", [
    (lambda d, n: d[:8] + b" " + d[9:], "does not start with '{'"),
    (lambda d, n: d + b"\0" * 16, "16 bytes after the last tensor"),
    (lambda d, n: struct.pack("<Q", 2**60) + d[8:], "header length"),
    (lambda d, n: d[:8] + d[8:8 + n].replace(b"{", b"{\xff", 1)[:n] + d[8 + n:],
     "not a valid JSON object"),
])
def test_corrupt_safetensors_bytes(src, tmp_path, capsys, mutate, needle):
    path = src / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(mutate(data, struct.unpack("<Q", data[:8])[0]))
    convert_refused(capsys, src, tmp_path / "dst", needle=needle)


def test_repeated_tensor_name_in_header(src, tmp_path, capsys):
    path = src / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    first = _by_offset(header)[0]
    text = json.dumps(header)
    entry = json.dumps({first: header[first]})[1:-1]
    rewrite_header(path, raw=("{" + entry + ", " + text[1:]).encode())
    convert_refused(capsys, src, tmp_path / "dst", needle="names repeated in the header")


def test_nonfinite_weights_are_refused(tmp_path, capsys):
    hf = H.llada_hf_config()
    tensors = H.random_tensors(hf, seed=3)
    tensors["model.transformer.blocks.1.ff_out.weight"][0, :3] = torch.tensor([NAN, INF, 1])
    path = H.write_checkpoint(tmp_path / "src", hf, tensors)
    convert_refused(capsys, path, tmp_path / "dst", needle="blocks.1.ff_out.weight (2)",
                    fast=False)


# --------------------------------------------------------------------------- LoRA

@pytest.fixture
def lora_case(tmp_path):
    hf = H.llada_hf_config()
    base = H.random_tensors(hf, seed=3)
    path = H.write_checkpoint(tmp_path / "src", hf, base)
    H.write_lora_adapter(tmp_path / "lora", base, ["q_proj", "v_proj"])
    return path, tmp_path / "lora"


@pytest.mark.parametrize("changes, needle", [
    ({"lora_alpha": NAN}, "lora_alpha=nan"),
    ({"lora_alpha": INF}, "lora_alpha=inf"),
    ({"lora_alpha": 0}, "lora_alpha=0"),
    ({"lora_alpha": -16}, "lora_alpha=-16"),
    ({"lora_alpha": "16"}, "lora_alpha='16'"),
    ({"lora_alpha": True}, "lora_alpha=True"),
    ({"r": 0}, "r=0"),
    ({"r": 2.5}, "r=2.5"),
    ({"r": 8}, "do not have the rank"),
    ({"rank_pattern": {"(": 4}}, "rank_pattern entries '(': 4"),
    ({"rank_pattern": {"q_proj": 0}}, "rank_pattern entries 'q_proj': 0"),
    ({"alpha_pattern": {"q_proj": NAN}}, "alpha_pattern entries 'q_proj': nan"),
    ({"alpha_pattern": ["q_proj"]}, "alpha_pattern=['q_proj']"),
    ({"target_modules": 5}, "target_modules=5"),
    ({"target_modules": "(q|v"}, "not a valid regular expression"),
    ({"use_rslora": "yes"}, "use_rslora='yes'"),
])
def test_bad_lora_settings(lora_case, tmp_path, capsys, changes, needle):
    """A NaN lora_alpha used to merge NaN weights, and --verify reported success."""
    path, lora = lora_case
    cfg = json.loads((lora / "adapter_config.json").read_text())
    cfg.update(changes)
    (lora / "adapter_config.json").write_text(json.dumps(cfg))
    convert_refused(capsys, path, tmp_path / "dst", "--lora", lora, needle=needle)


def test_nonfinite_lora_tensor_is_refused(lora_case, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    path, lora = lora_case
    tensors = load_file(str(lora / "adapter_model.safetensors"))
    name = next(k for k in tensors if k.endswith("blocks.0.q_proj.lora_A.weight"))
    tensors[name][0, 0] = NAN
    save_file(tensors, str(lora / "adapter_model.safetensors"))
    err = convert_refused(capsys, path, tmp_path / "dst", "--lora", lora,
                          needle="hold NaN or infinite values", fast=False)
    assert "merged with the LoRA adapter" in err


def test_verify_fails_on_nonfinite_logits(tmp_path, capsys, monkeypatch):
    """Finite weights whose logits overflow: --verify used to report 100% agreement.
    The converted model is loaded and run for real; the transformers reference (6 s of
    imports, checked by test_convert.py) is replaced by one with finite logits."""
    from checkpoints_convert import verify

    monkeypatch.setattr(verify, "build_reference", lambda hf, tensors, dtype: list(tensors))
    monkeypatch.setattr(verify, "reference_logits",
                        lambda ref, tokens: np.zeros((*tokens.shape, 64), np.float32))
    hf = H.llada_hf_config()
    tensors = H.random_tensors(hf, seed=4)
    tensors["model.transformer.ff_out.weight"].fill_(3e38)
    path = H.write_checkpoint(tmp_path / "src", hf, tensors)
    rc, out, err, _ = cli(capsys, "convert", path, tmp_path / "dst", "--no-progress",
                          "--dtype", "float32", "--verify")
    assert rc == 1, (out, err)
    one_line(err)
    assert "verify: FAILED" in err and "non-finite logits" in err


# --------------------------------------------------------------------------- signals

HOOKS = '''
import os, pathlib, time
phase = os.environ.get("HOSTILE_PHASE")
if phase:
    marker = pathlib.Path(os.environ["HOSTILE_MARKER"])
    from checkpoints_convert import convert as _c
    if phase == "reading":  # stop in the middle of the tensors
        _read, _seen = _c.read_output, []
        def read_output(*a, **k):
            _seen.append(1)
            if len(_seen) == 3:
                marker.write_text(phase)
                time.sleep(120)
            return _read(*a, **k)
        _c.read_output = read_output
    elif phase == "saving":  # stop inside orbax's save while a writer thread is busy
        # orbax and tensorstore write from threads of their own, which go on after the
        # main thread is interrupted; this one writes its file 1 s in, as they would
        # (creating the folders it needs), and the save waits for it, as orbax does.
        import asyncio, threading
        import orbax.checkpoint as ocp
        _serialize = ocp.type_handlers.NumpyHandler.serialize
        async def serialize(self, values, infos, args=None):
            late = pathlib.Path(str(infos[0].parent_dir)) / "late" / "chunk"
            def write():
                time.sleep(1.0)
                late.parent.mkdir(parents=True, exist_ok=True)
                late.write_text("written by a writer thread")
            writer = threading.Thread(target=write)
            writer.start()
            marker.write_text(phase)
            futures = await _serialize(self, values, infos, args)
            await asyncio.get_running_loop().run_in_executor(None, writer.join)
            return futures
        ocp.type_handlers.NumpyHandler.serialize = serialize
'''

ENTRY = {"python -m": [sys.executable, "-m", "checkpoints_convert"],
         "asynclane-jax": [os.path.join(os.path.dirname(sys.executable), "asynclane-jax"),
                           "convert"]}
# SIGTERM while reading is also where the unpatched "any" case mostly lands.
SIGNAL_CASES = [("python -m", "SIGINT", "reading"), ("python -m", "SIGTERM", "saving"),
                ("asynclane-jax", "SIGINT", "saving"), ("asynclane-jax", "SIGTERM", "any")]


def _default_sigint():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def signalled(tmp_path_factory):
    """Every signal case run at once, as real processes (they mostly wait on imports):
    case -> (returncode, stderr, output parent folder, seconds from signal to exit)."""
    root = tmp_path_factory.mktemp("signals")
    src = snapshot(root)[0]
    (root / "hooks").mkdir()
    (root / "hooks" / "sitecustomize.py").write_text(HOOKS)
    runs = {}
    for case in SIGNAL_CASES:
        entry, sig, phase = case
        out = root / "-".join(case).replace(" ", "")
        out.mkdir()
        env = dict(os.environ, JAX_PLATFORMS="cpu", HOSTILE_MARKER=str(out / "phase"),
                   PYTHONPATH=os.pathsep.join([str(root / "hooks"),
                                               os.environ.get("PYTHONPATH", "")]))
        if phase != "any":
            env["HOSTILE_PHASE"] = phase
        stderr = open(out / "stderr", "w+")
        # A job started in the background by a non-interactive shell inherits SIGINT
        # ignored, and Python then installs no KeyboardInterrupt handler: the child gets
        # SIGINT's default back, as a process started from a terminal has it.
        proc = subprocess.Popen([*ENTRY[entry], str(src), str(out / "dst"), "--no-progress"],
                                stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                                preexec_fn=_default_sigint)
        runs[case] = (proc, out, stderr)
    results, deadline, sent = {}, time.time() + 240, {}
    while len(sent) < len(runs) and time.time() < deadline:
        for case, (proc, out, _) in runs.items():
            if case in sent:
                continue
            ready = ((out / "phase").exists() if case[2] != "any"
                     else any(p.name.startswith(".dst.tmp-") for p in out.iterdir()))
            if ready or proc.poll() is not None:
                proc.send_signal(getattr(signal, case[1]))
                sent[case] = time.time()
        time.sleep(0.002)
    for case, (proc, out, stderr) in runs.items():
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        stderr.seek(0)
        results[case] = (proc.returncode, stderr.read(), out,
                         time.time() - sent.get(case, time.time()))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in SIGNAL_CASES if c[2] != "any"],
                         ids=lambda c: "-".join(c).replace(" ", ""))
def test_signal_during_conversion_leaves_nothing(signalled, case):
    rc, err, out, seconds = signalled[case]
    assert rc == 130, err
    one_line(err)
    assert "interrupted" in err
    assert not (out / "dst").exists()
    assert [p.name for p in out.iterdir() if p.name not in ("phase", "stderr")] == []
    # It ends (no hang); the bound is loose because a loaded 2-core machine runs four
    # such processes, each importing jax, at once.
    assert seconds < 300


@pytest.mark.slow
def test_signal_at_any_moment_leaves_a_whole_folder_or_nothing(signalled):
    """Unpatched, signalled as soon as the temporary folder appears: wherever it lands,
    either the conversion completed whole or nothing is left, and never a traceback."""
    rc, err, out, _ = signalled[("asynclane-jax", "SIGTERM", "any")]
    assert rc in (0, 130) and "Traceback" not in err, err
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
    if rc == 130:
        one_line(err)
    if (out / "dst").exists():  # it completed (the signal came too late to stop it)
        assert "nothing was written" not in err
        assert checkpoint.verify_folder(out / "dst") > 0


def test_an_interrupt_raised_where_python_drops_it_is_delivered_again(capfd):
    """A signal that lands in a __del__ or a garbage-collector callback (JAX has one)
    raises there, where Python prints the exception and drops it; inside the
    converter's handler it is raised again a moment later, with nothing printed."""
    import threading

    from checkpoints_convert.convert import sigterm_as_interrupt

    assert threading.current_thread() is threading.main_thread()  # pytest's own

    class Dropped:
        def __del__(self):
            raise KeyboardInterrupt  # as the signal handler does when it lands here

    deadline = time.monotonic() + 5
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
        Dropped()  # collected at once: its __del__ runs, and its exception is dropped
        while time.monotonic() < deadline:
            time.sleep(0.001)
    assert "Traceback" not in capfd.readouterr().err


def test_a_signal_landing_in_the_redelivery_hook_is_delivered_after_it(monkeypatch):
    """The signal can come again while the hook that asked for it still runs (a busy
    machine starts threads slowly), where raising would drop it once more: the handler
    then asks for it again instead of raising, and it arrives after the hook."""
    from checkpoints_convert.convert import sigterm_as_interrupt

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    deadline = time.monotonic() + 5
    with sigterm_as_interrupt():
        hook, term = sys.unraisablehook, signal.getsignal(signal.SIGTERM)

        class Landing:  # what the hook is given, read while a signal lands in it
            exc_traceback = None

            @property
            def exc_type(self):
                term(signal.SIGTERM, sys._getframe(1))  # the hook's own frame
                return ValueError

        try:
            hook(Landing())
        except KeyboardInterrupt:
            pytest.fail("the handler raised inside the hook, where it would be dropped")
        assert len(seen) == 1  # the ValueError went on to the hook before
        with pytest.raises(KeyboardInterrupt):
            while time.monotonic() < deadline:
                time.sleep(0.001)


# --------------------------------------------------------------------------- destinations

def test_dangling_symlink_destination(src, tmp_path, capsys):
    link = tmp_path / "dst"
    link.symlink_to(tmp_path / "nowhere")
    refused(capsys, "convert", src, link, "--no-progress", needle="symbolic link")
    assert link.is_symlink() and not (tmp_path / "nowhere").exists()
    assert leftovers(tmp_path) == []


def test_destination_under_a_file(src, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    refused(capsys, "convert", src, tmp_path / "file" / "dst", "--no-progress",
            needle="is a file, not a folder")


# --------------------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("name, content, needle", [
    ("tokenizer.json", b"{garbage", "tokenizer.json is not a valid tokenizer"),
    ("tokenizer.json", b"{}", "tokenizer.json is not a valid tokenizer"),
    ("tokenizer_config.json", b"[1, 2]", "not a JSON object"),
    ("tokenizer_config.json", b'{"chat_template": "{% for m in messages %}"}',
     "not valid Jinja"),
    ("chat_template.jinja", b"\xff\xfe{{ x }}", "chat_template.jinja is not"),
    ("special_tokens_map.json", b"\xff", "special_tokens_map.json is not valid JSON"),
])
def test_bad_tokenizer_files_are_refused_by_the_converter(src, tmp_path, capsys, name,
                                                          content, needle):
    (src / name).write_bytes(content)
    convert_refused(capsys, src, tmp_path / "dst", needle=needle)


@pytest.mark.parametrize("name, content, needle", [
    ("tokenizer.json", b"{garbage", "tokenizer.json is not a valid tokenizer"),
    ("tokenizer.json", b'{"model": 5}', "tokenizer.json is not a valid tokenizer"),
    ("tokenizer_config.json", b"{oops", "not a valid tokenizer config"),
    ("tokenizer_config.json", b'"text"', "not a valid tokenizer config"),
    ("tokenizer_config.json", b'{"chat_template": "{% if %}"}', "not valid Jinja"),
])
def test_bad_tokenizer_files_of_a_converted_folder(tmp_path, capsys, name, content, needle):
    folder = _converted_copy(tmp_path)
    (folder / name).write_bytes(content)
    refused(capsys, "generate", "hello", "--model", folder, needle=needle)
    with pytest.raises(CheckpointError, match=needle):
        asynclane_jax.load(folder)


# --------------------------------------------------------------------------- fuzzing

HOSTILE = st.one_of(
    st.text(max_size=12), st.just(NAN), st.just(INF), st.just(-INF),
    st.integers(-5, 64), st.integers(10**7, 2**70), st.integers(-(2**70), -(10**7)),
    st.floats(allow_nan=True, allow_infinity=True), st.none(), st.booleans(),
    st.lists(st.integers(-3, 70), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                st.integers(), max_size=2))
LLADA_FIELDS = ["d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                "mlp_ratio", "embedding_size", "vocab_size", "rope_theta", "rms_norm_eps",
                "mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id",
                "max_sequence_length", "include_qkv_bias", "weight_tying", "model_type",
                "architectures", "torch_dtype", "multi_query_attention", "rope_scaling",
                "layer_norm_type", "activation_type", "block_type", "clip_qkv"]
DREAM_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim",
                "rope_theta", "rms_norm_eps", "eos_token_id", "pad_token_id",
                "mask_token_id", "max_position_embeddings", "tie_word_embeddings",
                "hidden_act", "use_sliding_window", "rope_scaling", "architectures"]


@settings(FUZZ, max_examples=500)
@given(family=st.sampled_from(["llada", "dream"]), data=st.data())
def test_fuzz_hf_config_fields(family, data):
    fields = LLADA_FIELDS if family == "llada" else DREAM_FIELDS
    hf = (H.llada_hf_config if family == "llada" else H.dream_hf_config)()
    for _ in range(data.draw(st.integers(1, 3))):
        hf[data.draw(st.sampled_from(fields))] = data.draw(HOSTILE)
    t = time.process_time()
    try:
        cfg = from_hf_config(hf)
    except ConfigError as e:
        assert "\n" not in str(e)
    else:  # whatever was accepted is a config whose every field is sane
        assert all(isinstance(getattr(cfg, f), int) for f in ("d_model", "n_layers"))
        assert math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0
    assert time.process_time() - t < FAST


@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_fuzz_config_through_the_converter(tmp_path_factory, capsys, data):
    root = tmp_path_factory.mktemp("fuzz")
    path, hf, _ = snapshot(root)
    for _ in range(data.draw(st.integers(1, 2))):
        hf[data.draw(st.sampled_from(LLADA_FIELDS))] = data.draw(HOSTILE)
    (path / "config.json").write_text(json.dumps(hf))
    rc, _, err, _ = cli(capsys, "convert", path, root / "dst", "--no-progress")
    assert rc in (0, 2), err
    assert "Traceback" not in err
    if rc == 2:
        one_line(err)
        assert not (root / "dst").exists()
    assert leftovers(root) == []
    shutil.rmtree(root)


MODEL_FIELDS = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                "mlp_hidden", "rope_theta", "norm_eps", "qkv_bias", "tie_embeddings",
                "mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id",
                "max_seq_len", "dtype", "param_dtype", "block_causal", "family"]


@pytest.fixture(scope="module")
def fuzz_folder(tmp_path_factory):
    return _converted_copy(tmp_path_factory.mktemp("fuzz_folder"))


@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_fuzz_converted_config_fields(fuzz_folder, capsys, data):
    original = (fuzz_folder / "config.json").read_text()
    config = json.loads(original)
    for _ in range(data.draw(st.integers(1, 3))):
        config["model"][data.draw(st.sampled_from(MODEL_FIELDS))] = data.draw(HOSTILE)
    (fuzz_folder / "config.json").write_text(json.dumps(config))
    try:
        rc, _, err, seconds = cli(capsys, "info", "--model", fuzz_folder)
    finally:
        (fuzz_folder / "config.json").write_text(original)
    assert rc in (0, 2) and "Traceback" not in err
    if rc == 2:
        one_line(err)
        assert seconds < FAST


