"""The worker processes of a group (chapter 08): where they meet, and how they are stopped.

Tensor parallelism (`minillm.parallel.tensor`), pipeline parallelism (`minillm.parallel.pipeline`) and the
prefill/decode split (`minillm.parallel.disagg`) each start worker processes with `torch.multiprocessing` (spawn), which
rendezvous on a free port of this machine and take orders over pipes.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks one for port 0); a group's ranks
    rendezvous on it (`init_method="tcp://127.0.0.1:<port>"`).

    Another program could take it between now and the rendezvous: rare, and the run then fails loudly."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_workers(conns: Sequence[Any], processes: Sequence[Any], timeout: float = 10) -> None:
    """Tell each worker to stop (("stop",) on its pipe; a worker already gone is skipped), wait up to `timeout`
    seconds for each to exit, and kill those that do not."""
    for conn in conns:
        try:
            conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
    for process in processes:
        process.join(timeout=timeout)
        if process.is_alive():
            process.kill()
            process.join()
