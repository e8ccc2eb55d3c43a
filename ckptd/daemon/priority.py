"""CPU priority of the daemon's background threads.

The daemon shares its node's cores with the training processes it serves.  Checksumming and
writing a save is background work: it may take as long as the next save's interval, but it
must not delay the trainers (their copy into staging, the acknowledged Save, their
dataloaders).  Threads that persist saves therefore run at a lower CPU priority (a higher
nice value) than the event loop that answers RPCs.  Linux applies ``setpriority`` to one
thread when given its thread id; raising one's own nice value needs no privilege.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("ckptd.daemon")

MAX_NICE = 19
DEFAULT_IO_NICE = 10   # CFS weight 110 vs 1024: ~10% of a core contended with a trainer


def background_nice(delta: int) -> int:
    """The nice value for background threads: ``delta`` levels below the calling (main)
    thread, at most 19.  Computed once, on the main thread: a new Linux thread inherits
    the nice value of the thread that starts it, so a relative step taken in each thread
    would compound in threads started by background threads."""
    return min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, 0) + max(0, delta))


def set_this_thread(nice: int) -> None:
    """Give the calling thread the nice value ``nice`` (a thread pool ``initializer``).
    Best effort: where the platform refuses (lowering needs no privilege, raising does),
    the thread keeps its priority and a debug line says why."""
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) != nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as exc:
        log.debug("could not set the nice value of thread %d to %d: %s", tid, nice, exc)
