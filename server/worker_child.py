"""One child process of `fishgate serve --workers N` (server.workers starts it as `python -m server.worker_child ROLE
SLOT`): reads its orders, pickled, from stdin, then runs the engine (`fishgate engine`'s code) or a gateway on its own
listening socket, draining when the parent closes its control pipe. Owns nothing else.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys

from . import cli
from .settings import Settings
from .workers import gateway_listener, on_pipe_end


def child_main(role: str) -> int:
    """Run the child named by `role` ("engine" or "gateway"); its exit status."""
    job = pickle.loads(sys.stdin.buffer.read())  # from the parent, over a pipe only it holds
    settings: Settings = job["settings"]
    cli._configure_logging(settings.log_level, pid=True)
    if role == "engine":
        # the pipe's end: the parent stopped (after its gateways) or died; a signal drains as `fishgate engine`'s
        on_pipe_end(job["control_fd"], lambda: os.kill(os.getpid(), signal.SIGTERM))
        return cli.run_engine(settings, job["address"])
    from . import app  # noqa: F401 - imported before the socket listens: connections wait only for uvicorn's start

    try:
        listener = gateway_listener(settings.host, settings.port)
    except OSError as e:
        logging.getLogger("fishgate").critical("gateway could not listen on %s:%d: %s", settings.host, settings.port,
                                               e.strerror or e)  # fmt: skip
        return cli.EXIT_CONFIG_ERROR
    return cli.run_gateway(settings, listener=listener, control_fd=job["control_fd"])


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1]))
