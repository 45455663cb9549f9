"""Converted model folders: save, check and load.

A converted folder holds config.json, params/ (an orbax checkpoint of the parameters),
digests.json (a digest of every stored array) and the tokenizer files (`format`). The
same loader serves the shipped tiny models (by name) and converted 8B checkpoints.

Modules: `format` (file names, config.json, CheckpointError), `registry` (shipped
models), `integrity` (signal-safe writes, digests), `verify` (a folder on demand),
`save`, `restore` (arrays as stored, through orbax's public restore), `transform`
(dtype, int8, layer layout, placement), `load` (the two put together), `tokenizer`.
"""

from asynclane_jax.checkpoint.format import (
    COMMIT_MARKER,
    COMMIT_MARKER_TEXT,
    CONFIG_FILE,
    DIGESTS_FILE,
    FORMAT,
    FORMAT_VERSION,
    INT8_OUT_IN_KEY,
    PARAMS_DIR,
    QUANTIZATION_KEY,
    TOKENIZER_FILES,
    CheckpointError,
    flat_arrays,
    printable,
    read_config_file,
    stored_quantization,
    write_config,
)
from asynclane_jax.checkpoint.integrity import (
    DIGEST_ALGORITHM,
    DIGEST_CHUNK,
    DIGESTS_FORMAT,
    VERIFY_ENV,
    array_digest,
    digest_entry,
    read_digests,
    remove_tree,
    signals_held,
    write_digests,
)
from asynclane_jax.checkpoint.load import load, load_model, restore_params
from asynclane_jax.checkpoint.registry import (
    BUILTIN_MODELS_DIR,
    read_config,
    register_shipped,
    resolve,
    shipped_models,
    shipped_registry,
    unregister_shipped,
)
from asynclane_jax.checkpoint.save import params_to_numpy, save, save_params
from asynclane_jax.checkpoint.tokenizer import (
    check_chat_template,
    copy_tokenizer_files,
    load_tokenizer,
)
from asynclane_jax.checkpoint.transform import relayout_params
from asynclane_jax.checkpoint.verify import record_digests, verify_folder

__all__ = [
    "BUILTIN_MODELS_DIR", "COMMIT_MARKER", "COMMIT_MARKER_TEXT", "CONFIG_FILE",
    "DIGESTS_FILE", "DIGESTS_FORMAT", "DIGEST_ALGORITHM", "DIGEST_CHUNK", "FORMAT",
    "FORMAT_VERSION", "INT8_OUT_IN_KEY", "PARAMS_DIR", "QUANTIZATION_KEY", "TOKENIZER_FILES",
    "VERIFY_ENV", "CheckpointError", "array_digest", "check_chat_template",
    "copy_tokenizer_files", "digest_entry", "flat_arrays", "load", "load_model",
    "load_tokenizer", "params_to_numpy", "printable", "read_config", "read_config_file",
    "read_digests",
    "record_digests", "register_shipped", "relayout_params", "remove_tree", "resolve",
    "restore_params", "save", "save_params", "shipped_models", "shipped_registry",
    "signals_held", "stored_quantization", "unregister_shipped", "verify_folder",
    "write_config", "write_digests",
]
