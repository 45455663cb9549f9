"""The shipped models: names that `load` accepts in place of a folder path."""

from __future__ import annotations

import os
import pathlib

from asynclane_jax.checkpoint.format import CONFIG_FILE, CheckpointError, read_config_file
from asynclane_jax.models.config import ModelConfig, show

# Folder whose converted subfolders are the built-in shipped models, named by folder
# (the testbed's tiny models). It is listed on every lookup, not once at import, so a
# model exported there by the testbed trainer is loadable in the same process.
BUILTIN_MODELS_DIR = pathlib.Path(__file__).parent.parent / "testbed" / "models"

# Shipped models added by `register_shipped`: name -> converted folder.
_registered: dict[str, pathlib.Path] = {}


def _builtin_models() -> dict[str, pathlib.Path]:
    if not BUILTIN_MODELS_DIR.is_dir():
        return {}
    return {p.name: p for p in BUILTIN_MODELS_DIR.iterdir() if (p / CONFIG_FILE).is_file()}


def shipped_registry() -> dict[str, pathlib.Path]:
    """Every shipped model: name -> converted folder, built-in and registered, by name."""
    return dict(sorted({**_builtin_models(), **_registered}.items()))


def shipped_models() -> list[str]:
    """Names of the shipped models (the package's own and any registered)."""
    return list(shipped_registry())


def register_shipped(name: str, folder: str | os.PathLike, *, replace: bool = False) -> None:
    """Makes a converted folder loadable by name, like the package's own models.

    Args:
      name: the model name, e.g. "my-tiny-llada"; no path separators (a name must not
        read as a relative folder path).
      folder: the converted folder (holding config.json).
      replace: let `name` point to another folder than it already does (built-in
        names included).
    Raises:
      CheckpointError for a bad name, a folder that is not converted (or whose config.json
      is not an asynclane-jax one), or a name taken.
    """
    if not name or "/" in name or os.sep in name or name in (".", ".."):
        raise CheckpointError(f"shipped model name {name!r}: must be non-empty, without "
                              "path separators")
    path = pathlib.Path(folder).expanduser().absolute()
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path} is not a converted model folder (no {CONFIG_FILE})")
    read_config_file(path)  # refuses a Hugging Face snapshot or a malformed config now
    current = shipped_registry().get(name)
    if current is not None and current.absolute() != path and not replace:
        raise CheckpointError(f"shipped model {name!r} is already {current}; pass "
                              "replace=True to point it to another folder")
    _registered[name] = path


def unregister_shipped(name: str) -> None:
    """Removes a name added by `register_shipped` (built-in models stay)."""
    _registered.pop(name, None)


def resolve(path_or_name: str | os.PathLike) -> pathlib.Path:
    """Maps a shipped model name or a folder path to a converted folder.

    A folder path wins over a shipped name that reads the same.
    """
    try:
        return _resolve(path_or_name)
    except (OSError, ValueError) as e:  # a name too long for the OS, a NUL in a path
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"no model {show(str(path_or_name))}: {e}") from None


def _resolve(path_or_name: str | os.PathLike) -> pathlib.Path:
    p = pathlib.Path(path_or_name)
    if (p / CONFIG_FILE).is_file():
        return p
    shipped = shipped_registry().get(str(path_or_name))
    if shipped is not None:
        if not (shipped / CONFIG_FILE).is_file():  # a registered folder removed since
            raise CheckpointError(f"shipped model {str(path_or_name)!r}: {shipped} is no "
                                  f"longer a converted model folder (no {CONFIG_FILE})")
        return shipped
    if p.exists():
        raise CheckpointError(f"{p} is not a converted model folder (no {CONFIG_FILE})")
    raise CheckpointError(
        f"no model {str(path_or_name)!r}: not a folder, and not a shipped model "
        f"(shipped: {shipped_models() or 'none'})")


def read_config(folder: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Reads the config.json of a converted folder or shipped model; returns
    (ModelConfig, the whole json)."""
    return read_config_file(resolve(folder))
