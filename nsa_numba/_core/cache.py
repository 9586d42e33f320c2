"""The library's caches: bounded in entries and in bytes, safe across threads and
emptied in forked children.

Two use it: the prepared-call cache of ``_ops.pipeline`` (calls that come again) and
the planner's tile tables (``_ops.compress``). Neither holds arrays of the caller: only
what checking and planning derived from an argument's types, shapes, strides and
sequence values.
"""

import os
import threading
import weakref

_all = weakref.WeakSet()        # every cache, for the fork handler


class BoundedCache:
    """A mapping from hashable keys to values with a size in bytes, holding at most
    ``entries`` values and ``nbytes`` bytes; the oldest go first. A value larger than
    ``nbytes // 8`` is not kept (what needs that much is slow to call anyway). ``None``
    is never a key: ``get(None)`` is None.

    ``get`` takes no lock and moves nothing (a hit is every repeated call's first
    step, where a lock and a reordering cost more than the eviction order is worth)."""

    def __init__(self, entries, nbytes):
        self.max_entries = entries
        self.max_bytes = nbytes
        self._items = {}                 # key -> (value, bytes), oldest first
        self._bytes = 0
        self._lock = threading.Lock()
        _all.add(self)

    def get(self, key):
        """The value kept under ``key``, or None."""
        item = self._items.get(key)       # one dict lookup: atomic under the GIL
        return None if item is None else item[0]

    def put(self, key, value, nbytes):
        """Keep ``value`` (of ``nbytes``) under ``key`` unless the key is None, the
        value too large, or another thread kept one under the same key first."""
        if key is None or nbytes > self.max_bytes // 8:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                self._bytes -= self._items.pop(next(iter(self._items)))[1]

    def clear(self):
        with self._lock:
            self._items.clear()
            self._bytes = 0

    def __len__(self):
        return len(self._items)

    @property
    def nbytes(self):
        return self._bytes

    def values(self):
        with self._lock:
            return [value for value, _ in self._items.values()]

    def items(self):
        """(key, value) pairs, oldest first."""
        with self._lock:
            return [(key, value) for key, (value, _) in self._items.items()]

    def replace(self, key, value):
        """Put ``value`` in place of what ``key`` holds (same size), if anything."""
        with self._lock:
            if key in self._items:
                self._items[key] = (value, self._items[key][1])

    def _after_fork(self):
        """In a forked child: a new lock (another thread may have held the parent's
        at the fork, halfway through a change) and nothing kept."""
        self._lock = threading.Lock()
        self._items = {}
        self._bytes = 0


def _after_fork():
    for cache in list(_all):
        cache._after_fork()


if hasattr(os, "register_at_fork"):      # POSIX
    os.register_at_fork(after_in_child=_after_fork)
