"""A bounded, thread-safe cache of traced things (templates, replacements).

The pass runs inside jit traces and in the tuner's helper threads, so a
module-level cache must neither grow without bound nor break when two threads
fill it at once: entries are evicted least recently used first, and a value is
made outside the lock (tracing may take long and may itself use the cache), the
first one stored winning.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Hashable


class BoundedCache:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a cache holds at least one entry, got size {size}")
        self.size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], object]):
        """The value stored under `key`, else `make()`'s, stored."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = make()
        with self._lock:
            if key in self._entries:  # another thread made it meanwhile: one value per key
                self._entries.move_to_end(key)
                return self._entries[key]
            self._entries[key] = value
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
