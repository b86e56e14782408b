"""The grader's sandbox: a reader's notebook runs in its own process, never in the grader's (all chapters).

`minillm grade` must not believe anything a notebook says about itself: a notebook can redefine
`check`, patch the task registry, or print "passed". So the grader keeps two processes apart:

    grader (trusted)                               sandbox (the notebook's process)
    ----------------                               --------------------------------
    Sandbox(path).start()   -- spawns -->          limits on; every code cell run in order
                            <-- "ran", errors --
    the task's tests run here; each call of the
    reader's function is a request:
      call(answer, args)    -- pickled args -->    answer(*args), with the forbidden functions watched
                            <-- plain data --      the result: tensors, numbers, strings, lists, dicts

What comes back is read with `torch.load(weights_only=True)`, which builds tensors and Python's
plain containers and refuses every other class, so no object of the notebook's making ever reaches
the grader: the tests compare data the grader decoded itself, with its own code.

The sandbox process runs under limits: a memory cap (`RLIMIT_AS`) and CPU cap, bounded file sizes
and open files, and an audit hook (`sys.addaudithook`, which cannot be removed once added) that
refuses to start processes (so `os.fork` in a loop is one error, not a fork bomb), to open sockets,
and to write, delete or rename anything outside the sandbox's own temporary folder. Its output is
drained through a pipe of which only the last `LOG_KEEP_BYTES` are kept, so a flood costs nothing.
The grader enforces the wall-clock limits and kills the whole process group when they pass.

What this does not stop: code that attacks the sandbox's own Python objects (it shares the process
with the notebook) could fake its replies; the grader's source check (`minillm.book.grading.forgery`)
still sees what the notebook's text calls. Treat the sandbox as protection against forged grades
and runaway notebooks in a class, not as a security boundary for hostile code: run the grader
inside a container (or a VM) when that matters, as nbgrader and otter-grader also advise.
"""

from __future__ import annotations

import collections
import inspect
import io
import os
import select
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

LOG_KEEP_BYTES = 20_000  # of the notebook's own output: enough for the end of a traceback
DEFAULT_MEMORY_BYTES = 4 * 2**30  # on top of what the sandbox's own imports use
MAX_FILE_BYTES = 256 * 2**20
_HEADER = struct.Struct(">Q")


class SandboxError(RuntimeError):
    """The sandbox could not run the notebook or stopped answering; the message says why."""


class SandboxTimeoutError(SandboxError):
    """The notebook or one call of the reader's function ran past its time limit (the sandbox was killed)."""


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


def _receive(fd: int, deadline: float | None, trusted: bool) -> Any:
    """One message. From the sandbox (`trusted=False`) only plain data is accepted."""
    (length,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size, deadline))
    if length > 1 << 31:
        raise SandboxError(f"the sandbox sent a {length:,}-byte message; the grader reads at most 2 GiB")
    payload = io.BytesIO(_read_exactly(fd, length, deadline))
    return torch.load(payload, weights_only=not trusted)


# ---- what crosses back: plain data --------------------------------------------------------------


class Opaque:
    """Stands in, on the grader's side, for a returned object that is not plain data.

    Its class is named after the original's (`type(x).__name__` says `ndarray`), so the tests'
    messages ("expected a torch.Tensor, got ndarray") read as they would for the real object.
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def to_data(x: Any, depth: int = 0) -> Any:
    """x as plain data: tensors (plain class, on the CPU), numbers, strings, bytes, lists, tuples, dicts."""
    if depth > 20:
        return {"__opaque__": type(x).__name__, "repr": "(nested too deeply)"}
    if x is None or type(x) in (bool, int, float, complex, str, bytes):
        return x
    if isinstance(x, torch.Tensor):
        return torch.Tensor.as_subclass(x.detach(), torch.Tensor).cpu().clone()
    if type(x) in (torch.dtype, torch.Size):
        return x
    if type(x) in (list, tuple):
        return type(x)(to_data(v, depth + 1) for v in x)
    if type(x) is dict and all(type(k) in (str, int) for k in x):
        return {k: to_data(v, depth + 1) for k, v in x.items()}
    return {"__opaque__": type(x).__name__, "repr": _short_repr(x)}


def from_data(x: Any) -> Any:
    """Undo `to_data`'s marking of objects that were not plain data (see `Opaque`)."""
    if isinstance(x, dict):
        if set(x) == {"__opaque__", "repr"} and isinstance(x["__opaque__"], str):
            cls = type(x["__opaque__"], (Opaque,), {})
            return cls(str(x["repr"]))
        return {k: from_data(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(from_data(v) for v in x)
    return x


def _short_repr(x: Any) -> str:
    try:
        text = repr(x)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not break the reply
        text = f"<{type(x).__name__}>"
    return text if len(text) <= 200 else text[:199] + "…"


# ---- the grader's side --------------------------------------------------------------------------


class Sandbox:
    """One notebook, run in a process of its own; `call` runs the reader's functions there.

    timeout_s:    wall-clock seconds the notebook may take to run top to bottom
    memory_bytes: address space the notebook may use beyond the sandbox's own imports
    restarts:     how often a sandbox killed after a hung call is started again (re-running the notebook)
    """

    def __init__(self, notebook: str | Path, timeout_s: float = 600.0, memory_bytes: int = DEFAULT_MEMORY_BYTES,
                 restarts: int = 2) -> None:
        self.notebook = Path(notebook).resolve()
        self.timeout_s, self.memory_bytes, self.restarts_left = timeout_s, memory_bytes, restarts
        self.proc: subprocess.Popen | None = None
        self.cell_errors: list[str] = []
        self.cells = 0
        self._log: collections.deque[bytes] = collections.deque()
        self._log_size = 0
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def log(self) -> str:
        """The last `LOG_KEEP_BYTES` of what the notebook printed."""
        return b"".join(self._log).decode("utf-8", errors="replace")

    def start(self) -> None:
        """Run the notebook top to bottom in a fresh process; raises SandboxError if it cannot finish."""
        self.close()
        self._tmp = tempfile.TemporaryDirectory(prefix="minillm-grade-")
        work = self._tmp.name
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "TMPDIR": work, "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": os.path.join(work, ".matplotlib"), "IPYTHONDIR": os.path.join(work, ".ipython"),
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8",
        }
        cmd = [sys.executable, "-m", "minillm.book.grading.sandbox", str(self.notebook), str(req_r), str(rep_w),
               str(self.memory_bytes), str(int(self.timeout_s * 4 + 120))]
        self.proc = subprocess.Popen(cmd, pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=work, env=env,
                                     start_new_session=True)
        os.close(req_r)
        os.close(rep_w)
        self._log.clear()
        self._log_size = 0
        threading.Thread(target=self._drain, args=(self.proc.stdout,), daemon=True).start()
        reply = self._reply(time.monotonic() + self.timeout_s, what=f"the notebook did not finish within "
                                                                    f"{self.timeout_s:g} s (time limit)")
        self.cells, self.cell_errors = int(reply["cells"]), [str(e) for e in reply["errors"]]

    def call(self, answer: str, args: tuple, kwargs: dict, forbid: tuple[str, ...], deadline: float,
             probe: Callable | None = None) -> tuple[Any, list[str]]:
        """Run `answer(*args, **kwargs)` (or `probe(answer, *args, **kwargs)`) in the notebook's namespace.

        answer: a Python expression naming the reader's function there, e.g. "rms_norm".
        Returns (the result as plain data, the forbidden functions it called). Raises StudentError
        when the reader's code raised, SandboxTimeoutError past `deadline` (a time.monotonic() value).
        """
        from minillm.book.grading.registry import StudentError

        if self.proc is None or self.proc.poll() is not None:
            if self.restarts_left <= 0:
                raise SandboxError("the notebook's process was stopped after earlier calls hung, and no restarts "
                                   "are left")
            self.restarts_left -= 1
            self.start()
        probe_name = f"{probe.__module__}:{probe.__qualname__}" if probe is not None else None
        try:
            _send(self._req_w, {"kind": "call", "answer": answer, "args": args, "kwargs": kwargs,
                                "forbid": list(forbid), "probe": probe_name})
        except OSError as exc:
            raise SandboxError(f"the notebook's process stopped listening ({exc})") from None
        reply = self._reply(deadline, what="the call ran past the test's time limit")
        forbidden = [str(f) for f in reply.get("forbidden", [])]
        if reply["kind"] == "error":
            error = StudentError(str(reply["message"]))
            error.forbidden = forbidden  # type: ignore[attr-defined]
            raise error
        return from_data(reply["value"]), forbidden

    def _reply(self, deadline: float, what: str) -> dict:
        try:
            reply = _receive(self._rep_r, deadline, trusted=False)
        except SandboxTimeoutError:
            self.kill()
            raise SandboxTimeoutError(what) from None
        except EOFError:
            status = self.proc.wait() if self.proc is not None else None
            tail = [ln for ln in self.log.strip().splitlines() if ln.strip()][-1:]
            self.kill()
            raise SandboxError(f"the notebook's process ended (exit status {status})"
                               + (f"; its last output: {tail[0][:300]}" if tail else "")) from None
        except Exception as exc:  # noqa: BLE001 - anything unreadable means the channel was tampered with
            self.kill()
            raise SandboxError(f"the notebook's process sent something the grader refuses to read "
                               f"({type(exc).__name__}); was the grader's channel written to?") from None
        if not isinstance(reply, dict) or reply.get("kind") not in ("ran", "result", "error"):
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


class RemoteAnswer:
    """The grader's stand-in for the reader's function: calling it calls the real one in the sandbox.

    A task's tests receive this instead of the function and cannot tell the difference, except that
    results arrive as plain data. Every forbidden function the answer called is collected in
    `forbidden_calls`; `run_task` sets the time each test may take with `set_deadline`.
    """

    def __init__(self, sandbox: Sandbox, expression: str, forbid: tuple[str, ...]) -> None:
        self.sandbox, self.expression, self.forbid = sandbox, expression, forbid
        self.forbidden_calls: set[str] = set()
        self.deadline = time.monotonic() + 60
        self.timed_out = False  # once a call hangs, the task's remaining tests are not run

    def set_deadline(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(None, args, kwargs)

    def call_probed(self, probe: Callable, *args: Any) -> Any:
        return self._call(probe, args, {})

    def _call(self, probe: Callable | None, args: tuple, kwargs: dict) -> Any:
        from minillm.book.grading.check import _TimeLimitError
        from minillm.book.grading.registry import StudentError

        if self.timed_out:
            raise StudentError("not run: an earlier test of this task ran past its time limit")
        try:
            value, forbidden = self.sandbox.call(self.expression, args, kwargs, self.forbid, self.deadline, probe)
        except SandboxTimeoutError:
            self.timed_out = True
            raise _TimeLimitError() from None
        except StudentError as exc:
            self.forbidden_calls.update(getattr(exc, "forbidden", []))
            raise
        except SandboxError as exc:
            raise StudentError(str(exc)) from None
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


def _install_guard(work: str) -> None:
    """The audit hook: no processes, no sockets, no writes outside `work` (the sandbox's folder)."""
    root = os.path.realpath(work) + os.sep

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
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, 0))[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                     (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            if writes and path is not None and not inside(path):
                raise PermissionError(f"writing {path} is not allowed while a notebook is graded; write under the "
                                      "current folder")
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


def _watch_list(forbid: list[str]) -> tuple[dict[Any, str], dict[int, str]]:
    """Code objects (Python functions, and the methods of classes) and builtins to watch, by name."""
    from minillm.book.grading.forgery import forbidden_callables

    codes: dict[Any, str] = {}
    builtins: dict[int, str] = {}
    for name, target in forbidden_callables(forbid):
        if not isinstance(target, type):
            target = inspect.unwrap(target)  # a decorator's wrapper shares its code with every decorated function
        code = getattr(target, "__code__", None)
        if code is not None:
            codes[code] = name
        else:
            builtins[id(target)] = name
    return codes, builtins


def _call_watched(fn: Callable[[], Any], forbid: list[str]) -> tuple[Any, BaseException | None, list[str]]:
    """fn() with a profiler that notes every call of a forbidden function; returns (value, error, names)."""
    codes, builtins = _watch_list(forbid)
    hits: set[str] = set()

    def profiler(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            hits.add(codes[frame.f_code])
        elif event == "c_call" and id(arg) in builtins:
            hits.add(builtins[id(arg)])

    sys.setprofile(profiler)
    threading.setprofile(profiler)
    try:
        return fn(), None, sorted(hits)
    except BaseException as exc:  # noqa: BLE001 - reported to the grader, which decides
        return None, exc, sorted(hits)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _new_shell() -> Any:
    """An IPython shell without history, to run cells as Jupyter would (magics included)."""
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    return InteractiveShell.instance(config=config)


def _run_notebook(shell: Any, path: str) -> tuple[int, list[str]]:
    """Every code cell of the notebook, in order, in `shell`; a failing cell does not stop the rest."""
    import nbformat

    from minillm.book.grading.registry import summarise_exception

    nb = nbformat.read(path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    errors = []
    for number, source in enumerate(code, 1):
        result = shell.run_cell(source, store_history=False, silent=False)
        error = result.error_before_exec or result.error_in_exec
        if error is not None:
            errors.append(f"code cell {number}: {summarise_exception(error)}")
    return len(code), errors


def serve(notebook: str, request_fd: int, reply_fd: int, memory_bytes: int, cpu_s: int) -> int:
    """The sandbox process: run the notebook, then answer the grader's calls until it closes the pipe."""
    import importlib

    from minillm.book.grading import tasks  # noqa: F401 - the probes live in the task modules

    # (`import minillm.book.grading.check as m` would give the function `check`, which shadows its module)
    importlib.import_module("minillm.book.grading.check").GRADING = True
    shell = _new_shell()
    _apply_limits(memory_bytes, cpu_s)
    _install_guard(os.getcwd())
    cells, errors = _run_notebook(shell, notebook)
    _send(reply_fd, {"kind": "ran", "cells": cells, "errors": errors})
    while True:
        try:
            request = _receive(request_fd, None, trusted=True)
        except EOFError:
            return 0
        _send(reply_fd, _answer_call(request, shell.user_ns))


def _answer_call(request: dict, namespace: dict) -> dict:
    """Run one call the grader asked for, in the notebook's namespace; the reply to send back."""
    import importlib

    from minillm.book.grading.registry import summarise_exception

    try:
        answer = eval(request["answer"], namespace)  # noqa: S307 - the grader's own expression
    except Exception as exc:  # noqa: BLE001
        return {"kind": "error", "message": summarise_exception(exc), "forbidden": []}
    args, kwargs = request["args"], request["kwargs"]
    if request["probe"]:
        module, name = request["probe"].split(":")
        probe = getattr(importlib.import_module(module), name)
        value, error, hits = _call_watched(lambda: probe(answer, *args, **kwargs), request["forbid"])
    else:
        value, error, hits = _call_watched(lambda: answer(*args, **kwargs), request["forbid"])
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
        sys.exit("usage: python -m minillm.book.grading.sandbox NOTEBOOK REQUEST_FD REPLY_FD MEMORY_BYTES CPU_S "
                 "(started by `minillm grade`)")
    nb_path, req, rep, mem, cpu = sys.argv[1:]
    sys.exit(serve(nb_path, int(req), int(rep), int(mem), int(cpu)))
