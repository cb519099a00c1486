"""A Memory whose MLX calls are recorded (speculative/backend/memory.py's seam), as on a device with a wired limit."""

import threading

from speculative.backend.memory import Memory

OLD_LIMIT = 0  # the wired limit before Dyno takes the recommended one


class WatchedMemory:
    """Records each wired-limit change and buffer-cache clear; `wired` says whether the limit is held now."""

    def __init__(self, **cadence):
        self.calls = []  # "wire", "unwire", "clear", in order (with the thread each ran on in `threads`)
        self.threads = []
        self.wired = False
        self.on_clear = lambda: None  # a test's check, run at each clear
        self.memory = Memory(take_wired=self._take, set_wired=self._set, clear_cache=self._clear, **cadence)

    def _note(self, call: str) -> None:
        self.calls.append(call)
        self.threads.append(threading.current_thread().name)

    def _take(self):
        assert not self.wired, "the wired limit was taken twice"
        self.wired = True
        self._note("wire")
        return OLD_LIMIT

    def _set(self, limit):
        assert limit == OLD_LIMIT
        self.wired = False
        self._note("unwire")
        return limit

    def _clear(self):
        self._note("clear")
        self.on_clear()

    def count(self, call: str) -> int:
        return self.calls.count(call)
