"""Where the processes of a group meet: a free port on this machine (chapter 08)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks one for port 0); a group's ranks
    rendezvous on it (`init_method="tcp://127.0.0.1:<port>"`).

    Another program could take it between now and the rendezvous: rare, and the run then fails loudly."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
