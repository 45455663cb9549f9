import signal
import sys


def _terminate(signum, frame):
    raise KeyboardInterrupt


# Before the (slow) imports: a signal during them is one line too, not a traceback.
signal.signal(signal.SIGTERM, _terminate)
try:
    from checkpoints_convert.cli import main
except KeyboardInterrupt:
    print("checkpoints_convert: interrupted; nothing was written", file=sys.stderr)
    sys.exit(130)

status = main()
# The work is done (or undone): a signal arriving during the interpreter's shutdown must
# not turn the outcome into a traceback.
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
sys.exit(status)
