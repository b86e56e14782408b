"""The grader's sandbox: a reader's notebook runs in its own process, never in the grader's (all chapters).

`minillm grade` must not believe anything a notebook says about itself: a notebook can redefine
`check`, patch the task registry, or print "passed". So the grader keeps two processes apart:

    grader (trusted)                               sandbox (the notebook's process)
    ----------------                               --------------------------------
    Sandbox(path).start()   -- spawns, sends       limits on; every code cell run in order,
                               the cells -->       each under its own time limit
                            <-- "ran", errors --
    the task's tests run here; each call of the
    reader's function is a request:
      call(answer, args)    -- args by value -->   answer(*args), with the forbidden functions watched
                            <-- plain data --      the result: tensors, numbers, strings, lists, dicts
                            <-- review flags --    (a third pipe, written the moment they happen)

Both ways a message is plain data (`minillm.book.grading.wire`), read with
`torch.load(weights_only=True)`, which builds tensors and Python's plain containers and refuses every
other class: no object of the notebook's making ever reaches the grader, and the tests compare data
the grader decoded itself, with its own code.

**What stays in the grader.** Everything that decides a grade: the task modules (references, tests,
expected values and the hints built from them), the instructor's hidden tests, and the fingerprints
of the code an answer must not call. The sandbox cannot even read the task modules (their folder is
an empty mount there). A call brings the sandbox the inputs by value, the name of a probe from
`minillm.book.grading.probes` where a test watches the answer from the inside (probes observe and
hold no answers), and, for the call watcher, a digest of each forbidden function's fingerprint: it
can tell a call of one when it sees it, and cannot rebuild one from it.

**Isolation from the operating system.** The sandbox process runs inside bubblewrap (`bwrap`, the
tool Flatpak uses): new user, pid, network, ipc, uts and mount namespaces, as the unprivileged
uid 65534, with no capabilities. Its file system holds only what a notebook needs, read-only: the
system's /usr and /etc, the Python installation and the `minillm` package. The class folder, the
book's solutions, the instructor's hidden tests and every other process's /proc are not there at
all; the notebook's cells come through a pipe, so not even its own path is. Its one writable folder
is a private home (`/home/student`) that the grader deletes afterwards. The grader and the tests
stay outside.

Memory: where systemd and cgroup v2 are there, each sandbox runs in a scope of its own whose `MemoryMax`
counts every page it holds (`memory_scope`); everywhere, bubblewrap loads a seccomp filter that refuses
`memfd_create` (memory outside the address space; `seccomp.py`), and the home is a size-limited tmpfs.
Inside, as before: a memory cap (`RLIMIT_AS`) and CPU cap, bounded file sizes and open files, and
an audit hook (`sys.addaudithook`, which cannot be removed once added) that refuses to start
processes, to open sockets, and to write outside the home folder, and that reports, through its
own pipe and at once, what an honest exercise never does: looking through the interpreter's
objects (`gc`), switching the profiler off, C-level access (`ctypes`), running code built from a
string, reading notebooks, other processes' /proc or the grader's own source. The grader puts
these on the task as *review flags* for the teacher. Output is drained through a pipe of which only
the last `LOG_KEEP_BYTES` are kept. The grader enforces the wall-clock limits and kills the whole
sandbox when they pass.

What this does not stop: code written against this harness can still tamper with the Python objects
of its own process (it shares it with the harness), so it could fake its *own* replies, once it has
raised the flags that say it looked. It cannot reach another student's files or grade, the
solutions or the hidden tests. Where bubblewrap is missing, `minillm grade` refuses to run a class's
notebooks; `--no-sandbox` runs them with the in-process limits only, for a learner grading their
own work.
"""

from __future__ import annotations

import collections
import dis
import functools
import hashlib
import inspect
import io
import json
import os
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minillm.book.grading.registry import _is_library_file
from minillm.book.grading.wire import WireError, decode, encode, from_data, to_data

LOG_KEEP_BYTES = 20_000  # of the notebook's own output: enough for the end of a traceback
DEFAULT_MEMORY_BYTES = 4 * 2**30  # on top of what the sandbox's own imports use
DEFAULT_DISK_BYTES = 512 * 2**20  # the sandbox's home, a tmpfs: what its files may hold in all
MAX_FILE_BYTES = 256 * 2**20
DEFAULT_CELL_TIMEOUT_S = 120.0  # one code cell; a cell past it is interrupted and the notebook goes on
CELL_GRACE_S = 10.0  # a cell that the interrupt cannot stop (stuck in C code) is skipped after this much more
MAX_SKIPPED_CELLS = 3  # ...and the notebook re-run without it, at most this often
TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # never readable in the sandbox
PROBE_MODULES = ("minillm.book.grading.probes",)  # the probes a sandbox can import (it cannot see the tasks)
ACK_WAIT_S = 2.0  # how long the grader waits for a call's acknowledgement on the flag pipe, after its reply
EXIT_GRACE_S = 5.0  # a process whose reply channel closed has this long (within the deadline) to end by itself
LATE_GRACE_S = 10.0  # a call past its limit is waited for this much longer before the process is stopped
SANDBOX_HOME = "/home/student"  # the notebook's writable folder, inside bubblewrap
SANDBOX_UID = 65534  # "nobody"
_HEADER = struct.Struct(">Q")


class SandboxError(RuntimeError):
    """The sandbox could not run the notebook or stopped answering; the message says why."""


class SandboxTimeoutError(SandboxError):
    """The notebook or one call of the reader's function ran past its time limit (the sandbox was killed)."""


class SandboxLateError(SandboxTimeoutError):
    """A call returned after its time limit but within LATE_GRACE_S of it: the test fails, the process (warm by
    now) is kept, so one slow first call does not cost the task's other tests a restart."""

    def __init__(self, late_s: float, forbidden: list[str]) -> None:
        super().__init__(f"returned {late_s:.1f} s after the time limit")
        self.late_s, self.forbidden = late_s, forbidden


class SandboxUnavailableError(SandboxError):
    """bubblewrap is missing or cannot create namespaces here; the message says how to fix it."""


# ---- bubblewrap ---------------------------------------------------------------------------------


def readonly_paths() -> list[str]:
    """What the notebook's process must read besides /usr and /etc: Python, its packages, minillm itself.

    The folder that holds the `minillm` package (a source checkout, with `solutions/`, in an editable
    install) is not among them: only the package's own folder is.
    """
    import minillm

    package = Path(minillm.__file__).resolve().parent
    candidates = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    candidates |= {Path(sys.executable).parent, Path(sys.executable).resolve().parent, package}
    candidates |= {Path(p).resolve() for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    found = sorted(p for p in candidates if p.is_dir() and not p.is_relative_to("/usr") and p != Path("/"))
    return [str(p) for i, p in enumerate(found) if not any(p.is_relative_to(q) for q in found[:i])]


def bwrap_command(disk_bytes: int | None = None, seccomp_fd: int | None = None) -> list[str]:
    """bubblewrap's arguments: fresh namespaces, uid 65534, read-only system and Python, and a writable home of
    its own: a tmpfs of at most `disk_bytes` (default DEFAULT_DISK_BYTES), in memory rather than on the host's
    disk, so that neither the disk nor the memory beyond it can be filled through files. `seccomp_fd`: a pipe
    holding `seccomp.program()` (see `seccomp_pipe`), which refuses memory held outside the address space."""
    args = ["bwrap", "--unshare-all", "--as-pid-1", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # usually links into /usr
        path = Path("/", name)
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    # bubblewrap mounts in the order given, a later mount over an earlier one: the empty /tmp comes first, so
    # that Python and its packages stay visible when they live under /tmp (a checkout and its .venv there).
    args += ["--ro-bind", "/etc", "/etc", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for path in readonly_paths():
        args += ["--ro-bind", path, path]
    args += ["--tmpfs", str(TASKS_DIR)]  # the references and tests: an empty folder in the sandbox, wherever minillm is
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    size = str(DEFAULT_DISK_BYTES if disk_bytes is None else int(disk_bytes))
    return args + ["--size", size, "--perms", "0700", "--tmpfs", SANDBOX_HOME, "--chdir", SANDBOX_HOME]


def seccomp_pipe() -> int:
    """The read end of a pipe that holds the sandbox's seccomp filter (bubblewrap reads it whole); the caller passes
    it to bwrap and closes it after."""
    from minillm.book.grading.seccomp import program

    read, write = os.pipe()
    os.write(write, program())  # about a hundred bytes: far below a pipe's buffer
    os.close(write)
    return read


CGROUP_V2 = Path("/sys/fs/cgroup/cgroup.controllers")  # present where the cgroup v2 hierarchy is mounted alone
MEMORY_BASELINE_BYTES = 2**30  # what Python, torch and the harness hold resident before the notebook's first cell


@functools.cache
def memory_scope() -> list[str] | None:
    """The command that runs a sandbox in a cgroup v2 scope of its own, where a memory limit counts every page the
    notebook holds (memfd, tmpfs, page tables: not only its address space), or None where this machine has none.

    It is systemd's: `systemd-run [--user] --scope -p MemoryMax=...` (a user's own manager for an unprivileged
    grader). Without cgroup v2 or systemd (a container, a cgroup v1 host) the sandbox is bounded by its address
    space (RLIMIT_AS), with memfd_create refused and its home a size-limited tmpfs (`memory_cap`)."""
    systemd_run = shutil.which("systemd-run")  # by its path: the sandbox's own PATH is a fixed, short one
    if systemd_run is None or not CGROUP_V2.exists():
        return None
    command = [systemd_run, *([] if os.getuid() == 0 else ["--user"]), "--scope", "--quiet", "--collect"]
    try:
        probe = subprocess.run([*command, "-p", "MemoryMax=256M", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return command if probe.returncode == 0 else None


def memory_cap(memory_bytes: int = DEFAULT_MEMORY_BYTES, disk_bytes: int = DEFAULT_DISK_BYTES) -> str:
    """How a sandbox of `memory_bytes` and `disk_bytes` (`Sandbox`'s) is bounded on this machine, in words: what
    `minillm grade` prints first."""
    gib = memory_bytes / 2**30
    if memory_scope() is not None:
        return (f"memory: a cgroup v2 scope per notebook (MemoryMax {gib + MEMORY_BASELINE_BYTES / 2**30:g} GiB, "
                "no swap), and its address space")
    from minillm.book.grading.seccomp import refused_on

    return (f"memory: each notebook's address space ({gib:g} GiB past its imports); no cgroup v2 scope here "
            f"(systemd-run with cgroup v2), so memory outside it is bounded instead: refused {refused_on()}, "
            f"files in a {disk_bytes // 2**20} MiB tmpfs home")


INSTALL_BWRAP = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; Fedora: `sudo dnf install "
                 "bubblewrap`), or pass --no-sandbox to grade your own notebooks with the in-process limits only")


@functools.cache
def isolation_problem() -> str | None:
    """None when bubblewrap can isolate a notebook on this machine; else what is wrong and what to do."""
    if shutil.which("bwrap") is None:
        return f"bubblewrap (bwrap) is not installed, and the grader runs untrusted notebooks only inside it: " \
               f"{INSTALL_BWRAP}"
    seccomp = seccomp_pipe()  # the filter too: a kernel that refuses it must say so here, not in every notebook
    try:
        proc = subprocess.run([*bwrap_command(seccomp_fd=seccomp), sys.executable, "-c", "pass"], capture_output=True,
                              text=True, timeout=60, pass_fds=(seccomp,))
    except subprocess.TimeoutExpired:
        return "bubblewrap did not start Python within 60 s"
    finally:
        os.close(seccomp)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"bubblewrap is installed but cannot create a sandbox here ({why}); unprivileged user namespaces "
                f"may be turned off (sysctl kernel.unprivileged_userns_clone=1), or run the grader outside a "
                f"container that forbids them. Otherwise {INSTALL_BWRAP.split(', or ')[1]}")
    return None


# ---- framing: an 8-byte length, then a torch.save payload ---------------------------------------


def _send(fd: int, obj: Any) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    data = memoryview(_HEADER.pack(len(payload)) + payload)
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise SandboxTimeoutError("time limit")
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _receive(fd: int, deadline: float | None) -> Any:
    """One message: plain data only, whichever side sent it (`minillm.book.grading.wire`)."""
    (length,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    if length > 1 << 31:
        raise SandboxError(f"the sandbox sent a {length:,}-byte message; the grader reads at most 2 GiB")
    payload = io.BytesIO(_read_exactly(fd, length, deadline))
    return torch.load(payload, weights_only=True)


# ---- the grader's side --------------------------------------------------------------------------


class Sandbox:
    """One notebook, run in a process of its own; `call` runs the reader's functions there.

    timeout_s:      wall-clock seconds the notebook may take to run top to bottom
    cell_timeout_s: seconds one code cell may take; it is then interrupted and the next cell runs
    memory_bytes:   address space the notebook may use beyond the sandbox's own imports
    restarts:       how often, per task, a sandbox stopped after a hung call is started again (re-running the
                    notebook); the next task starts with as many again, and the message names why it stopped
    isolate:        run inside bubblewrap (see the module's docstring); False only for one's own notebooks
    disk_bytes:     what the notebook's files may hold in all, in bubblewrap (its home is a tmpfs that size)

    After `start`, `cell_errors` says which cells failed or were interrupted, and `flags` holds the review
    flags the sandbox raised (each a dict: "flag", the reason, and "task", the task being tested or None).
    """

    def __init__(self, notebook: str | Path, timeout_s: float = 600.0, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 restarts: int = 2, cell_timeout_s: float = DEFAULT_CELL_TIMEOUT_S, isolate: bool = True,
                 disk_bytes: int = DEFAULT_DISK_BYTES) -> None:
        self.notebook = Path(notebook).resolve()
        self.disk_bytes = disk_bytes
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self.restarts = self.restarts_left = restarts
        self.restart_s = 0.0  # time spent re-running the notebook after a stop (see `call`)
        self.stopped_because = ""  # why the process was last stopped during a call, for the message that follows
        self._task: str | None = None  # the task whose calls spend `restarts_left`
        self.cell_timeout_s, self.isolate = cell_timeout_s, isolate
        self.proc: subprocess.Popen | None = None
        self.cell_errors: list[str] = []
        self.cells = 0
        self.flags: list[dict] = []
        self._skipped: dict[int, str] = {}  # cells left out of later runs: they could not be interrupted
        self._log: collections.deque[bytes] = collections.deque()
        self._log_size = 0
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._acks: set[str] = set()  # the calls whose end the flag pipe acknowledged (their nonces)
        self._acked = threading.Condition()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def log(self) -> str:
        """The last `LOG_KEEP_BYTES` of what the notebook printed."""
        return b"".join(self._log).decode("utf-8", errors="replace")

    def start(self) -> None:
        """Run the notebook top to bottom in a fresh process; raises SandboxError if it cannot finish.

        A cell that runs past `cell_timeout_s` is interrupted there and the next one runs; one that cannot
        be interrupted (stuck in C code) is skipped in a fresh process. The whole run has `timeout_s`.
        """
        import nbformat

        if self.isolate and isolation_problem() is not None:
            raise SandboxUnavailableError(isolation_problem())
        nb = nbformat.read(self.notebook, as_version=4)  # read here: the sandbox never sees the notebook's path
        cells = [c.source for c in nb.cells if c.cell_type == "code"]
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._spawn()
            _send(self._req_w, {"kind": "run", "cells": cells, "skip": sorted(self._skipped),
                                "cell_timeout_s": self.cell_timeout_s})
            cell, reply = 0, None
            while reply is None or reply["kind"] == "cell":
                cell_deadline = time.monotonic() + self.cell_timeout_s + CELL_GRACE_S if cell else deadline
                try:
                    reply = self._reply(min(deadline, cell_deadline), what="")
                except SandboxTimeoutError:
                    if time.monotonic() >= deadline or len(self._skipped) >= MAX_SKIPPED_CELLS:
                        where = f" (it was in code cell {cell})" if cell else ""
                        raise SandboxTimeoutError(f"the notebook did not finish within {self.timeout_s:g} s "
                                                  f"(time limit){where}") from None
                    self._skipped[cell] = (f"code cell {cell}: ran past its {self.cell_timeout_s:g} s limit and "
                                           f"could not be interrupted, so the notebook was run again without it")
                    break
                if reply["kind"] == "cell":
                    cell = int(reply["number"])
            else:
                self.cells, self.cell_errors = int(reply["cells"]), [str(e) for e in reply["errors"]]
                return

    def _spawn(self) -> None:
        """A fresh sandbox process (in bubblewrap when isolating), with its three pipes."""
        self.kill()
        if self._tmp is not None:
            self._tmp.cleanup()
        self._tmp = tempfile.TemporaryDirectory(prefix="minillm-grade-")
        home = SANDBOX_HOME if self.isolate else self._tmp.name
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        audit_r, audit_w = os.pipe()
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": os.path.join(home, ".matplotlib"), "IPYTHONDIR": os.path.join(home, ".ipython"),
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8",
        }
        cmd = [sys.executable, "-m", "minillm.book.grading.sandbox", str(req_r), str(rep_w), str(audit_w),
               str(self.memory_bytes), str(int(self.timeout_s * 4 + 120))]
        fds = [req_r, rep_w, audit_w]
        if self.isolate:
            fds.append(seccomp_pipe())
            cmd = bwrap_command(self.disk_bytes, seccomp_fd=fds[-1]) + cmd
            scope = memory_scope()
            if scope is not None:  # resident memory capped by the kernel, every page the notebook holds counted
                limit = self.memory_bytes + MEMORY_BASELINE_BYTES
                cmd = [*scope, "-p", f"MemoryMax={limit}", "-p", "MemorySwapMax=0", "--", *cmd]
        self.proc = subprocess.Popen(cmd, pass_fds=fds, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=self._tmp.name,
                                     env=env, start_new_session=True)
        for fd in fds:
            os.close(fd)
        self._log.clear()
        self._log_size = 0
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
        self._flag_reader = threading.Thread(target=self._read_flags, args=(audit_r,), daemon=True)
        self._flag_reader.start()

    def _read_flags(self, fd: int) -> None:
        """Collect the review flags the sandbox's audit hook writes, one JSON object per line."""
        with os.fdopen(fd, "rb") as stream:
            for line in stream:
                try:
                    flag = json.loads(line)
                    if isinstance(flag, dict) and set(flag) == {"ack"}:
                        with self._acked:
                            self._acks.add(str(flag["ack"]))
                            self._acked.notify_all()
                        continue
                    flag = {"flag": str(flag["flag"])[:300], "task": flag.get("task") and str(flag["task"])}
                except (ValueError, KeyError, TypeError):
                    flag = {"flag": "the sandbox's flag channel carried something else (was it written to?)",
                            "task": None}
                if flag not in self.flags and len(self.flags) < 50:
                    self.flags.append(flag)

    def call(self, answer: str, args: tuple, kwargs: dict, forbid: tuple[str, ...], deadline: float,
             probe: Callable | None = None, task: str | None = None) -> tuple[Any, list[str]]:
        """Run `answer(*args, **kwargs)` (or `probe(answer, *args, **kwargs)`) in the notebook's namespace.

        answer: a Python expression naming the reader's function there, e.g. "rms_norm".
        task:   the task being tested, so that a review flag raised during the call names it.
        Returns (the result as plain data, the forbidden functions it called). Raises StudentError
        when the reader's code raised; past `deadline` (a time.monotonic() value), SandboxLateError if the call
        still returned within LATE_GRACE_S (the process is kept), else SandboxTimeoutError (it was stopped). A
        restart's re-run of the notebook extends the deadline by its own time (`restart_s` adds it up).
        """
        from minillm.book.grading.registry import StudentError

        probe_name = f"{probe.__module__}:{probe.__qualname__}" if probe is not None else None
        if probe is not None and not (probe.__module__ in PROBE_MODULES and "<" not in probe.__qualname__):
            # The sandbox imports a probe by name, and sees only minillm's library and the probes module: a probe
            # of a task module or a hidden test's own file would crash it in every notebook. This is the
            # teacher's test to fix, not the student's code.
            raise ProbeError(f"the test passes the probe {probe_name} to call_probed, but the sandbox can only "
                             f"import module-level probes of {' or '.join(PROBE_MODULES)}; call the answer "
                             "directly in the test, or use one of those probes")
        try:
            sent_args, sent_kwargs = encode(args), encode(kwargs)
        except WireError as exc:
            raise ProbeError(f"the test's call cannot reach the sandbox: {exc}") from None
        if task != self._task:  # each task has its own restarts: one hung task does not zero the next
            self._task, self.restarts_left = task, self.restarts
        if self.proc is None or self.proc.poll() is not None:
            if self.restarts_left <= 0:
                raise SandboxError(f"the notebook's process was stopped {self.restarts + 1} times during this task's "
                                   f"tests (last: {self.stopped_because or 'it ended'}), so its other tests were not "
                                   "run; make the function return within the test's time limit")
            self.restarts_left -= 1
            started = time.monotonic()
            self.start()
            spent = time.monotonic() - started  # the notebook's re-run is not the call's time
            self.restart_s += spent
            deadline += spent
        nonce = secrets.token_hex(8)  # the flag pipe must acknowledge this call by it: silence is a flag
        try:
            _send(self._req_w, {"kind": "call", "answer": answer, "args": sent_args, "kwargs": sent_kwargs,
                                "watch": watch_list(tuple(forbid)), "probe": probe_name, "task": task,
                                "nonce": nonce})
        except OSError as exc:
            raise SandboxError(f"the notebook's process stopped listening ({exc})") from None
        reply = self._reply(deadline + LATE_GRACE_S, what="the call ran past the test's time limit")
        late_s = time.monotonic() - deadline
        with self._acked:  # written before the reply: a short wait covers the reader thread's delay
            acked = self._acked.wait_for(lambda: nonce in self._acks, timeout=ACK_WAIT_S)
            self._acks.discard(nonce)
        if not acked:
            flag = {"flag": "the sandbox's flag channel did not acknowledge a call (was it closed or replaced?), so "
                            "flags raised during the tests may be missing", "task": task}
            if flag not in self.flags:
                self.flags.append(flag)
        forbidden = [str(f) for f in reply.get("forbidden", [])]
        if late_s > 0:
            raise SandboxLateError(late_s, forbidden)
        if reply["kind"] == "error":
            error = StudentError(str(reply["message"]))
            error.forbidden = forbidden  # type: ignore[attr-defined]
            raise error
        if reply["kind"] != "result":
            self.kill()
            raise SandboxError("the notebook's process sent a malformed reply")
        return from_data(reply["value"]), forbidden

    def _reply(self, deadline: float, what: str) -> dict:
        try:
            reply = _receive(self._rep_r, deadline)
        except SandboxTimeoutError:
            self.kill()
            self.stopped_because = what or "the notebook ran past its time limit"
            raise SandboxTimeoutError(what) from None
        except EOFError:
            # The reply pipe closed. The process may have ended, or closed the pipe and gone on (asleep, say):
            # it gets a few seconds, within the deadline, to end by itself, and is stopped either way.
            status = None
            if self.proc is not None:
                try:
                    status = self.proc.wait(timeout=max(0.0, min(EXIT_GRACE_S, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    status = "still running, so it was stopped"
            tail = [ln for ln in self.log.strip().splitlines() if ln.strip()][-1:]
            self.kill()
            self.stopped_because = f"its reply channel closed (exit status {status})"
            raise SandboxError(f"the notebook's process closed its reply channel (exit status {status})"
                               + (f"; its last output: {tail[0][:300]}" if tail else "")) from None
        except Exception as exc:  # noqa: BLE001 - anything unreadable means the channel was tampered with
            self.kill()
            raise SandboxError(f"the notebook's process sent something the grader refuses to read "
                               f"({type(exc).__name__}); was the grader's channel written to?") from None
        if not isinstance(reply, dict) or reply.get("kind") not in ("cell", "ran", "result", "error"):
            self.kill()
            raise SandboxError("the notebook's process sent a malformed reply")
        return reply

    def _drain(self, stream: Any) -> None:
        for chunk in iter(lambda: stream.read1(65536), b""):
            self._log.append(chunk)
            self._log_size += len(chunk)
            while self._log_size > LOG_KEEP_BYTES and len(self._log) > 1:
                self._log_size -= len(self._log.popleft())

    def kill(self) -> None:
        """Stop the sandbox and everything it started (its process group)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        reader = self.__dict__.pop("_flag_reader", None)
        if reader is not None:
            reader.join(timeout=5)  # the flag pipe ends with the process: every flag it wrote is read
        for name in ("_req_w", "_rep_r"):
            fd = self.__dict__.pop(name, None)
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        self.kill()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class ProbeError(ValueError):
    """A test's call that cannot reach the sandbox (a probe it cannot import, an argument it cannot send by value):
    the test's fault, never the notebook's."""


class RemoteAnswer:
    """The grader's stand-in for the reader's function: calling it calls the real one in the sandbox.

    A task's tests receive this instead of the function and cannot tell the difference, except that
    results arrive as plain data. Every forbidden function the answer called is collected in
    `forbidden_calls`; `run_task` sets the time each test may take with `set_deadline`.
    """

    def __init__(self, sandbox: Sandbox, expression: str, forbid: tuple[str, ...], task: str | None = None) -> None:
        self.sandbox, self.expression, self.forbid, self.task = sandbox, expression, forbid, task
        self.forbidden_calls: set[str] = set()
        self.deadline = time.monotonic() + 60

    def set_deadline(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(None, args, kwargs)

    def call_probed(self, probe: Callable, *args: Any) -> Any:
        return self._call(probe, args, {})

    def _call(self, probe: Callable | None, args: tuple, kwargs: dict) -> Any:
        from minillm.book.grading.check import _TimeLimitError
        from minillm.book.grading.registry import StudentError

        restarted = self.sandbox.restart_s
        try:
            value, forbidden = self.sandbox.call(self.expression, args, kwargs, self.forbid, self.deadline, probe,
                                                 self.task)
        except SandboxLateError as exc:  # the test fails; the task's next tests run on the same, warm process
            self.forbidden_calls.update(exc.forbidden)
            raise _TimeLimitError(exc.late_s) from None
        except SandboxTimeoutError:  # stopped: the next call starts the notebook again, within the task's restarts
            raise _TimeLimitError() from None
        except StudentError as exc:
            self.forbidden_calls.update(getattr(exc, "forbidden", []))
            raise
        except SandboxError as exc:
            raise StudentError(str(exc)) from None
        finally:
            self.deadline += self.sandbox.restart_s - restarted  # a restart's time is not the test's
        self.forbidden_calls.update(forbidden)
        return value


# ---- the sandbox's side -------------------------------------------------------------------------

_BLOCKED_EVENTS = {
    "os.fork": "starting processes", "os.forkpty": "starting processes", "os.posix_spawn": "starting processes",
    "os.spawn": "starting processes", "os.system": "running shell commands", "os.exec": "starting programs",
    "subprocess.Popen": "starting processes", "pty.spawn": "starting processes",
    "os.kill": "sending signals", "os.killpg": "sending signals",
    "socket.connect": "network access", "socket.bind": "network access", "socket.sendto": "network access",
    "socket.sendmsg": "network access", "socket.getaddrinfo": "network access",
}
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "shutil.rmtree", "os.chmod", "os.chown", "os.truncate",
                "os.link", "os.symlink", "os.mkdir", "os.utime", "shutil.copyfile", "shutil.move"}
# Events an honest exercise never raises from its own code: each is a review flag for the teacher.
_FLAGGED_EVENTS = {
    "gc.get_objects": "searched the interpreter's objects (gc.get_objects)",
    "gc.get_referrers": "searched the interpreter's objects (gc.get_referrers)",
    "gc.get_referents": "searched the interpreter's objects (gc.get_referents)",
    "sys.setprofile": "changed the profiler, which watches the answer's calls (sys.setprofile)",
    "sys.settrace": "changed the tracer (sys.settrace)",
    "sys._current_frames": "read the frames of running code (sys._current_frames)",
    "exec": "ran code built from a string (exec or eval)",
}
_GRADING_DIR = str(Path(__file__).resolve().parent) + os.sep
_flag_state: dict[str, Any] = {"fd": None, "task": None, "sent": set()}


def raise_flag(reason: str) -> None:
    """Send a review flag to the grader now, on the flag pipe, naming the task being tested (if any)."""
    key = (reason.split(" (")[0], _flag_state["task"])  # once per kind: the first path or event is example enough
    if _flag_state["fd"] is None or key in _flag_state["sent"]:
        return
    _flag_state["sent"].add(key)
    line = json.dumps({"flag": reason, "task": _flag_state["task"]}) + "\n"
    try:
        os.write(_flag_state["fd"], line.encode())
    except OSError:
        pass


def _acknowledge(nonce: str | None) -> None:
    """Tell the grader, on the flag pipe, that a call is done: its nonce. A pipe that carries no acknowledgement
    (closed, or replaced by the notebook) is itself a flag on the grader's side."""
    if nonce is not None and _flag_state["fd"] is not None:
        try:
            os.write(_flag_state["fd"], (json.dumps({"ack": nonce}) + "\n").encode())
        except OSError:
            pass


def _is_readers_frame(frame: Any) -> bool:
    """Whether a frame runs the notebook's code (a cell, or code it built from a string), not a library's."""
    name = frame.f_code.co_filename
    return not name.startswith("<frozen") and not _is_library_file(name)


_REPORTING_MODULES = ("traceback.py", "warnings.py", "<frozen importlib._bootstrap_external>")


def _readers_code_on_stack(frame: Any) -> bool:
    """Whether the notebook's code asked for what is happening: its frame is on the stack, and no library
    that reads source files on its own account (a traceback, a warning, an import) stands in between."""
    while frame is not None:
        if frame.f_code.co_filename.endswith(_REPORTING_MODULES):
            return False
        if _is_readers_frame(frame):
            return True
        frame = frame.f_back
    return False


def _suspicious_read(path: Any) -> str | None:
    """Why reading `path` is a review flag (a notebook, another process's /proc, the grader's source), or None."""
    try:
        real = os.path.realpath(os.fsdecode(path))
    except (TypeError, ValueError):
        return None
    if real.endswith(".ipynb"):
        return f"opened a notebook file ({real})"
    if real.startswith("/proc/") and not real.startswith(("/proc/self/", f"/proc/{os.getpid()}/")):
        return f"read another process's information ({real})"
    if real.startswith(_GRADING_DIR):
        return f"read the grader's own files ({real.removeprefix(_GRADING_DIR)})"
    return None


def _install_guard(work: str, flag_fd: int | None = None) -> None:
    """The audit hook: no processes, no sockets, no writes outside `work` (the sandbox's folder); review
    flags (see `_FLAGGED_EVENTS`) written to `flag_fd` the moment the reader's code raises them."""
    root = os.path.realpath(work) + os.sep
    _flag_state["fd"] = flag_fd

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return True  # an already-open file descriptor
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == "/dev/null" or (real + os.sep).startswith(root)

    def hook(event: str, args: tuple) -> None:
        if event in _BLOCKED_EVENTS:
            raise PermissionError(f"{_BLOCKED_EVENTS[event]} is not allowed while a notebook is graded ({event})")
        if event in _FLAGGED_EVENTS:
            if _is_readers_frame(sys._getframe(1)):  # called by the notebook's own code, not by a library
                raise_flag(_FLAGGED_EVENTS[event])
        elif event.startswith("ctypes.") and _readers_code_on_stack(sys._getframe(1)):
            raise_flag(f"used ctypes, which reaches past Python's checks ({event})")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                     (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            if writes and path is not None and not inside(path):
                raise PermissionError(f"writing {path} is not allowed while a notebook is graded; write under the "
                                      "current folder")
            if path is not None and not isinstance(path, int):
                why = _suspicious_read(path)
                if why and _readers_code_on_stack(sys._getframe(1)):
                    raise_flag(why)
        elif event in _PATH_EVENTS:
            if event == "shutil.copyfile":
                args = args[1:]  # reading the source is fine; only the destination is written
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            if any(not inside(p) for p in paths):
                raise PermissionError(f"{event} outside the notebook's folder is not allowed while it is graded")

    sys.addaudithook(hook)


def _apply_limits(memory_bytes: int, cpu_s: int) -> None:
    import resource

    vm = 0
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                vm = int(line.split()[1]) * 1024
    except OSError:
        pass
    limits = [(resource.RLIMIT_AS, vm + memory_bytes), (resource.RLIMIT_CPU, cpu_s),
              (resource.RLIMIT_FSIZE, MAX_FILE_BYTES), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NOFILE, 256)]
    if os.getuid() != 0:  # root ignores RLIMIT_NPROC; the audit hook is the bound there
        limits.append((resource.RLIMIT_NPROC, 64 + _count_own_processes()))
    for which, value in limits:
        soft, hard = resource.getrlimit(which)
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, hard))


def _count_own_processes() -> int:
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def code_fingerprint(code: Any) -> tuple:
    """What a code object *does*, without its name, file, line numbers, docstring or the names of its locals: a
    copy of a function's source exec'd under another name, its locals renamed and its docstring dropped, has the
    same fingerprint as the original.

    It is read from the instructions (`dis`), not the raw bytecode, because the same source compiles to other
    bytes in other places: a notebook cell is compiled statement by statement, so `torch.full(...)` in a cell's
    function is a method load where a module that imports torch itself loads an attribute, and the jumps move
    with the cache slots. So: locals by number (their names dropped), globals and attributes by name, constants
    by value, jumps by the instruction they reach; method and attribute loads alike."""
    kept = [i for i in dis.get_instructions(code) if i.opname not in _LAYOUT_OPS]
    index = {i.offset: n for n, i in enumerate(kept)}
    steps = []
    for i in kept:
        if i.opcode in _JUMPS:
            arg: Any = index.get(i.argval, min((n for off, n in index.items() if off >= i.argval), default=-1))
        elif i.opcode in dis.hasconst:
            arg = code_fingerprint(i.argval) if inspect.iscode(i.argval) else _constant_key(i.argval)
        elif i.opcode in dis.hasname:
            arg = i.argval
        else:
            arg = i.arg
        steps.append((_SAME_OP.get(i.opname, i.opname), arg))
    return tuple(steps), code.co_argcount, code.co_kwonlyargcount, code.co_flags & _SHAPE_FLAGS


COPY_MIN_STEPS = 40  # instructions: a copy of a shorter function is not flagged (see _call_watched)
_LAYOUT_OPS = {"CACHE", "NOP", "RESUME", "EXTENDED_ARG", "PUSH_NULL", "PRECALL", "KW_NAMES"}  # no meaning of their own
_SAME_OP = {"LOAD_METHOD": "LOAD_ATTR"}  # which one the compiler picks depends on where the code was compiled
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)
_SHAPE_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE


def _constant_key(c: Any) -> tuple:
    """A constant as the same text in every process: a frozenset's repr follows string hashing, which differs."""
    if isinstance(c, (frozenset, set)):
        return type(c).__name__, tuple(sorted(repr(_constant_key(v)) for v in c))
    if isinstance(c, tuple):
        return "tuple", tuple(_constant_key(v) for v in c)
    return type(c).__name__, repr(c)


@functools.lru_cache(maxsize=1 << 16)  # the watcher sees the same library code in every call
def fingerprint_digest(code: Any) -> str:
    """sha-256 of `code_fingerprint(code)`: enough to recognise the code, not to rebuild it."""
    return hashlib.sha256(repr(code_fingerprint(code)).encode()).hexdigest()


@functools.cache
def watch_list(forbid: tuple[str, ...]) -> dict:
    """What the sandbox's call watcher looks for, computed in the grader: {"codes": {digest of a forbidden Python
    function's fingerprint: its dotted path}, "builtins": [paths of forbidden C functions]}. The fingerprints (a
    task module's reference among them) stay here; the sandbox finds the builtins, library functions, itself."""
    from minillm.book.grading.forgery import forbidden_callables

    codes: dict[str, str] = {}
    builtins: list[str] = []
    for name, target in forbidden_callables(forbid):
        if not isinstance(target, type):
            target = inspect.unwrap(target)  # a decorator's wrapper shares its code with every decorated function
        code = getattr(target, "__code__", None)
        if code is not None:
            codes[fingerprint_digest(code)] = name
        elif name not in builtins:
            builtins.append(name)
    return {"codes": codes, "builtins": builtins}


@functools.cache
def _builtin_ids(paths: tuple[str, ...]) -> dict[int, str]:
    """In the sandbox: the forbidden C functions by id (they have no code to fingerprint)."""
    from minillm.book.grading.forgery import forbidden_callables

    return {id(target): name for name, target in forbidden_callables(paths)
            if getattr(target, "__code__", None) is None}


def _call_watched(fn: Callable[[], Any], watch: dict) -> tuple[Any, BaseException | None, list[str]]:
    """fn() with a profiler that notes every call of a forbidden function, matched by what its code does;
    returns (value, error, names). A match in the library's own files is a call (no credit); a match in the
    notebook's code, a copy with its names and docstring changed, is a review flag once it is COPY_MIN_STEPS
    instructions long (a one-line formula is written alike by everyone). Switching the profiler off is a flag."""
    codes, builtins = watch["codes"], _builtin_ids(tuple(watch["builtins"]))
    seen: dict[Any, tuple[str, bool] | None] = {}  # code object -> (forbidden name, a real call?), looked up once
    hits: set[str] = set()
    copies: set[str] = set()

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code not in seen:
                name = codes.get(fingerprint_digest(code))
                called = _is_library_file(code.co_filename)
                big = len(code_fingerprint(code)[0]) >= COPY_MIN_STEPS
                seen[code] = (name, called) if name is not None and (called or big) else None
            if seen[code] is not None:
                name, called = seen[code]
                (hits if called else copies).add(name)
        elif event == "c_call" and id(arg) in builtins:
            hits.add(builtins[id(arg)])

    running = _notebook_threads()
    sys.setprofile(profiler)
    threading.setprofile(profiler)  # threads the call starts
    if running and hasattr(threading, "setprofile_all_threads"):  # Python 3.12: threads already running too
        threading.setprofile_all_threads(profiler)
    elif running:
        raise_flag(f"{len(running)} thread(s) the notebook started were running during the call, where the "
                   "grader cannot watch their calls")
    try:
        return fn(), None, sorted(hits)
    except BaseException as exc:  # noqa: BLE001 - reported to the grader, which decides
        return None, exc, sorted(hits)
    finally:
        if sys.getprofile() is not profiler:
            raise_flag("switched off the profiler that watches the answer's calls")
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        if running and hasattr(threading, "setprofile_all_threads"):
            threading.setprofile_all_threads(None)
        for name in sorted(copies - hits):
            raise_flag(f"ran a copy of {name}: the same instructions once names and docstrings are set aside")


_LIBRARY_THREADS = ("tqdm.", "torch.", "IPython.", "concurrent.", "multiprocessing.", "threading")


def _notebook_threads() -> list[threading.Thread]:
    """The live threads besides this one that the notebook's code started (a library's own, tqdm's monitor say,
    aside): the profiler set for a call does not reach threads that were already running."""
    here = threading.current_thread()
    return [t for t in threading.enumerate() if t is not here and t is not threading.main_thread()
            and not (type(t).__module__.startswith(_LIBRARY_THREADS) and type(t) is not threading.Thread)]


def _new_shell() -> Any:
    """An IPython shell without history, to run cells as Jupyter would (magics included)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    return InteractiveShell.instance(config=config)


class CellTimeLimit(BaseException):
    """Raised in a code cell that ran past its time limit (a BaseException, so `except Exception` lets it pass)."""


def _run_notebook(shell: Any, cells: list[str], skip: set[int], cell_timeout_s: float,
                  reply_fd: int) -> list[str]:
    """Every code cell, in order, in `shell`, each under `cell_timeout_s`; a failing or interrupted cell does not
    stop the rest. Tells the grader which cell starts (so it can name a cell that hangs). Returns the errors."""
    from minillm.book.grading.registry import summarise_exception

    def on_alarm(signum: int, frame: Any) -> None:
        raise CellTimeLimit()

    signal.signal(signal.SIGALRM, on_alarm)
    errors = []
    for number, source in enumerate(cells, 1):
        if number in skip:
            errors.append(f"code cell {number}: ran past its {cell_timeout_s:g} s limit and could not be "
                          "interrupted, so the notebook was run again without it")
            continue
        _send(reply_fd, {"kind": "cell", "number": number})
        signal.setitimer(signal.ITIMER_REAL, cell_timeout_s)
        try:
            result = shell.run_cell(source, store_history=False, silent=False)
            error = result.error_before_exec or result.error_in_exec
        except CellTimeLimit as exc:
            error = exc
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if isinstance(error, CellTimeLimit):
            errors.append(f"code cell {number}: ran past its {cell_timeout_s:g} s limit and was interrupted")
        elif error is not None:
            errors.append(f"code cell {number}: {summarise_exception(error)}")
    return errors


def serve(request_fd: int, reply_fd: int, flag_fd: int, memory_bytes: int, cpu_s: int) -> int:
    """The sandbox process: run the cells the grader sends, then answer its calls until it closes the pipe."""
    import importlib

    from minillm.book.grading import probes  # noqa: F401 - what a test's call may bring in (never the tasks)

    # (`import minillm.book.grading.check as m` would give the function `check`, which shadows its module)
    importlib.import_module("minillm.book.grading.check").GRADING = True
    shell = _new_shell()
    _apply_limits(memory_bytes, cpu_s)
    _install_guard(os.getcwd(), flag_fd)
    run = _receive(request_fd, None)
    errors = _run_notebook(shell, run["cells"], set(run["skip"]), run["cell_timeout_s"], reply_fd)
    _send(reply_fd, {"kind": "ran", "cells": len(run["cells"]), "errors": errors})
    while True:
        try:
            request = _receive(request_fd, None)
        except EOFError:
            return 0
        _flag_state["task"] = request.get("task")
        reply = _answer_call(request, shell.user_ns)
        _flag_state["task"] = None
        _acknowledge(request.get("nonce"))  # after the call's flags, before its reply: the grader waits for it
        _send(reply_fd, reply)


def _answer_call(request: dict, namespace: dict) -> dict:
    """Run one call the grader asked for, in the notebook's namespace; the reply to send back."""
    import importlib

    from minillm.book.grading.registry import summarise_exception

    try:
        answer = eval(compile(request["answer"], "<grader>", "eval"), namespace)  # noqa: S307 - the grader's own
    except Exception as exc:  # noqa: BLE001
        return {"kind": "error", "message": summarise_exception(exc), "forbidden": []}
    args, kwargs = decode(request["args"]), decode(request["kwargs"])
    if request["probe"]:
        module, name = request["probe"].split(":")
        probe = getattr(importlib.import_module(module), name)
        value, error, hits = _call_watched(lambda: probe(answer, *args, **kwargs), request["watch"])
    else:
        value, error, hits = _call_watched(lambda: answer(*args, **kwargs), request["watch"])
    if error is not None:
        return {"kind": "error", "message": summarise_exception(error), "forbidden": hits}
    try:
        data = to_data(value)
        io_check = io.BytesIO()
        torch.save(data, io_check)  # fails here, not half-way through the reply
    except Exception as exc:  # noqa: BLE001
        return {"kind": "error", "message": f"the result could not be sent back to the grader: {exc}",
                "forbidden": hits}
    return {"kind": "result", "value": data, "forbidden": hits}


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit("usage: python -m minillm.book.grading.sandbox REQUEST_FD REPLY_FD FLAG_FD MEMORY_BYTES CPU_S "
                 "(started by `minillm grade`)")
    req, rep, flag, mem, cpu = sys.argv[1:]
    sys.exit(serve(int(req), int(rep), int(flag), int(mem), int(cpu)))
