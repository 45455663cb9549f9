"""Per-request sampler options on the engine (no program compiled here): a traced option
(a threshold) at any valid value keeps the pool of the server's configuration; a
structural one must be the operator's or an allowed configuration's, else
OptionNotAllowed naming what is allowed; and `serve --allow-options` as the engine
takes it. The same through HTTP with the openai client: test_serve_http.py."""

from __future__ import annotations

import pytest
from serve_fakes import MODEL, engine_arguments

from asynclane_jax.errors import UsageError
from asynclane_jax.serve import cli
from asynclane_jax.serve.engine import MAX_CONFIGS, Engine, EngineError, OptionNotAllowed


@pytest.fixture(scope="module")
def eng(loaded):
    model, tok, _ = loaded
    return Engine(model, tok, model_name=MODEL, sampler="fast-dllm",
                  options={"cache": "dual", "threshold": 0.9}, slots=2, gen_lengths=(32,),
                  max_prompt=32, precompile="none", allow_options=[{"cache": "prefix"}])


def test_thresholds_share_the_servers_pool_and_reach_the_row(eng):
    base = eng._key(None, 32, 32)
    for t in (0.5, 0.81, 0.811, 0.999, 1.0):
        assert eng._key({"threshold": t}, 32, 32) == base
        assert eng._request_schedule({"threshold": t}, 32).traced_values() == {"threshold": t}
    assert eng._request_schedule(None, 32).traced_values() == {"threshold": 0.9}
    # The server's own value of a structural option is no change.
    assert eng._key({"cache": "dual", "threshold": 0.6}, 32, 32) == base
    # An allowed configuration is a pool of its own, thresholds again shared in it.
    other = eng._key({"cache": "prefix"}, 32, 32)
    assert other != base and other[0].cache == "prefix"
    assert eng._key({"cache": "prefix", "threshold": 0.7}, 32, 32) == other
    # Values stay checked on the host.
    for bad in (0.0, 1.5, "high"):
        with pytest.raises(EngineError) as err:
            eng._key({"threshold": bad}, 32, 32)
        assert not isinstance(err.value, OptionNotAllowed)
        assert "threshold" in str(err.value) or bad == "high"
    # /health names the per-request options instead of a placeholder value.
    shown = eng._shown(base[0])
    assert shown["per_request"] == ["threshold"] and "threshold" not in shown
    assert shown["cache"] == "dual"


def test_structural_options_not_allowed_name_what_is(eng):
    for options, sent in (({"cache": "none"}, "cache='none'"),
                          ({"block_length": 16, "threshold": 0.5}, "block_length=16"),
                          ({"cache": "prefix", "early_stop": True}, "early_stop=True")):
        with pytest.raises(OptionNotAllowed) as err:
            eng._key(options, 32, 32)
        msg = str(err.value)
        assert sent in msg and "threshold" in msg, msg
        assert "cache='dual'" in msg and "cache='prefix'" in msg, msg  # both configurations
    with pytest.raises(OptionNotAllowed, match="block_length=32"):
        eng._key({"block_length": 16}, 32, 32)


def test_allowed_configurations_are_bounded_and_read_as_the_samplers_types(loaded):
    model, tok, _ = loaded
    with pytest.raises(EngineError, match=f"at most {MAX_CONFIGS - 1}"):
        Engine(model, tok, model_name=MODEL, sampler="fast-dllm", gen_lengths=(32,),
               max_prompt=32, allow_options=[{"block_length": 4 * (i + 1)}
                                             for i in range(MAX_CONFIGS)])
    assert cli.allowed_configs("fast-dllm", ["cache=prefix,block-length=16", "early_stop=on"]) \
        == [{"cache": "prefix", "block_length": 16}, {"early_stop": True}]
    assert cli.allowed_configs("fast-dllm", None) == []
    for bad in ("cache", "block_length=x", "nope=1"):
        with pytest.raises(UsageError, match="--allow-options"):
            cli.allowed_configs("fast-dllm", [bad])


def test_the_command_line_hands_the_engine_its_configurations(monkeypatch):
    """`serve --allow-options` reaches the engine (stood in for: nothing is loaded)."""
    seen = engine_arguments(monkeypatch, [
        "--sampler", "fast-dllm", "--cache", "dual", "--allow-options", "cache=prefix",
        "--allow-options", "cache=none,block_length=16"])
    assert seen["options"] == {"cache": "dual"}
    assert seen["allow_options"] == [{"cache": "prefix"},
                                     {"cache": "none", "block_length": 16}]
