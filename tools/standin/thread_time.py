"""Per-thread CPU time of this process (Linux): what each thread ran, and waited to run, so far.

On a shared machine wall time says little about where a round's work goes: other processes slow every
phase by whatever they happen to run. The time a thread spent running (and, apart from it, the time it
spent runnable but waiting for a core) is read from /proc/self/task/<tid>/schedstat in nanoseconds.
MLX's CPU backend computes on worker threads, so their run time is the round's device work, the main
thread's its Python, and a worker's wall time neither running nor waiting is time it had nothing
queued (the engine failing to keep it fed).
"""

import os
import threading
import time
from typing import Dict, NamedTuple, Tuple

from speculative.errors import DynoError

TASKS = "/proc/self/task"


def thread_times() -> Dict[int, Tuple[int, int]]:
    """{thread id: (ns run, ns runnable but waiting for a core)} for every thread of this process."""
    if not os.path.isdir(TASKS):
        raise DynoError(f"per-thread CPU time needs Linux's {TASKS}/<tid>/schedstat, absent here")
    out = {}
    for tid in os.listdir(TASKS):
        try:
            with open(f"{TASKS}/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):  # the thread ended while listed
            continue
        out[int(tid)] = (int(run), int(wait))
    return out


class Usage(NamedTuple):
    """Seconds over an interval: wall, the main thread's run time, all other threads' run time, and the
    busiest other thread's run, wait and idle time (idle: wall minus run minus wait)."""

    wall: float
    main: float
    workers: float
    busiest_run: float
    busiest_wait: float

    @property
    def busiest_idle(self) -> float:
        return self.wall - self.busiest_run - self.busiest_wait


class Stamp(NamedTuple):
    wall: float
    threads: Dict[int, Tuple[int, int]]


def stamp() -> Stamp:
    return Stamp(time.perf_counter(), thread_times())


def since(start: Stamp, main: int = None) -> Usage:
    """Usage from `start` to now; `main` the main thread's id (default: the calling thread's)."""
    end = stamp()
    main = threading.get_native_id() if main is None else main
    delta = {t: (r - start.threads.get(t, (0, 0))[0], w - start.threads.get(t, (0, 0))[1])
             for t, (r, w) in end.threads.items()}
    own = delta.pop(main, (0, 0))
    busiest = max(delta.values(), default=(0, 0))
    return Usage(end.wall - start.wall, own[0] / 1e9, sum(r for r, _ in delta.values()) / 1e9,
                 busiest[0] / 1e9, busiest[1] / 1e9)
