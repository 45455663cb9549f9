"""Records digests.json in converted folders written before digests were recorded.

  python -m checkpoints_convert.record_digests DIR [DIR ...] [--force]

Each stored array is read as it is now and its digest written with the function the
converter uses (`asynclane_jax.checkpoint.record_digests` -> `digest_entry`); nothing
else in the folder changes. Run it only on folders whose arrays are known to be good
(the shipped models were recorded this way): from then on `load` and
`asynclane-jax verify` detect any change to them.
"""

from __future__ import annotations

import argparse
import sys

from asynclane_jax.checkpoint import DIGESTS_FILE, CheckpointError, record_digests, resolve


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpoints_convert.record_digests",
                                description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", metavar="DIR",
                   help="converted folders (or shipped model names)")
    p.add_argument("--force", action="store_true",
                   help=f"replace an existing {DIGESTS_FILE}")
    args = p.parse_args(argv)
    try:
        for name in args.folders:
            folder = resolve(name)
            if (folder / DIGESTS_FILE).exists() and not args.force:
                raise CheckpointError(f"{folder} already has {DIGESTS_FILE}; pass --force to "
                                      "replace it")
            n = record_digests(folder)
            print(f"{folder}: {n} array digests recorded in {DIGESTS_FILE}")
    except CheckpointError as e:
        print(f"record_digests: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
