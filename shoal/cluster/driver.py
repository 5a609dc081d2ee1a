"""A Shoal process joining the Ray cluster as a driver, its SIGTERM kept its own.

A front end (shoal.cluster.membership) and a sandbox host's server
(shoal.cluster.slots) call Ray as drivers. Connecting one installs Ray's crash
handler (abseil's failure signal handler) for SIGTERM too, over the server's
own: on SIGTERM it printed a stack trace and passed the signal on to the drain,
but it also armed an alarm that aborted the process (SIGABRT) three seconds
later. Every drain that took longer (a call still running, containers to
snapshot, a loaded machine) was cut there, its calls with it; and a host that
died by SIGABRT is not one that was drained, so the front ends started a new
host on the node being taken out, and its containers answered "starting;
retry" instead of moving. Once connected, SIGTERM goes back to the handler it
had; the crash signals keep Ray's.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

import ray


async def connect(address: str, namespace: str) -> None:
    """``ray.init`` (on a thread: it blocks), then SIGTERM's handler as it was,
    and the shoal and uvicorn loggers as they were."""
    # Only the main thread sets handlers; a server's lifespan runs there.
    main = threading.current_thread() is threading.main_thread()
    handler = signal.getsignal(signal.SIGTERM) if main else None
    await asyncio.to_thread(ray.init, address=address, namespace=namespace,
                            logging_level=logging.WARNING, log_to_driver=False)
    # Ray's handler went in beneath Python's (sigaction): getsignal still names
    # the drain's, and setting it again puts it back in the kernel.
    if handler is not None:
        signal.signal(signal.SIGTERM, handler)
    # Ray's logging set-up (dictConfig) disables the loggers that existed
    # before it: ours keep logging.
    for name, logger in logging.Logger.manager.loggerDict.items():
        if name.startswith(("shoal", "uvicorn")) and isinstance(logger, logging.Logger):
            logger.disabled = False
