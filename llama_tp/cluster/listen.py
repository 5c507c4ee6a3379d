"""The listening socket of an HTTP front (the server's rank 0, the supervisor's front
door), bound before anything slow starts, so that a port in use is one line at once."""

from __future__ import annotations

import socket


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (an error names the address, e.g. a port in use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock
