"""Handing the C heap's freed memory back to the OS, at most every so often (glibc's malloc_trim).

A merge allocates and frees arrays of a fragment's size (offers, wires, the outer step's outputs,
broadcasts), on several threads. glibc keeps what is freed in its heaps for the next allocation,
and after the first free of a large block it serves blocks up to 32 MB from them instead of
mapping them: the heaps fragment and the process's resident memory climbs with the run, though
what it holds does not. Measured with the 33.7M model under two busy loops
(docs/limits.md): a decoupled run's resident memory rose from 3.0 to 4.1 GB over 48 steps and a
data-parallel one's wandered between 2.8 and 3.6 GB, against about 1.8 GB held in both (their
level with the heap trimmed every 0.5 s).

`malloc_trim(0)` returns every free page of every heap (madvise); the pages are faulted in again
when the heap grows back, which costs the threads that allocate: trimmed every second, a
data-parallel run of that model stepped 5-12% slower. The syncer asks after a merge, at most every
`config.syncer.heap_trim_every_s`, and trims only when the heaps hold at least `MIN_FREE_BYTES`
free (glibc's mallinfo2): a small model's run never does. Where the C library has no malloc_trim
(not glibc) nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

MIN_FREE_BYTES = 256 << 20  # free in the heaps before a trim is worth its page faults


class _MallInfo2(ctypes.Structure):
  _fields_ = [(name, ctypes.c_size_t) for name in (
      "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
      "fordblks", "keepcost")]


def _libc():
  try:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
  except OSError:
    return None


def _free_heap_bytes() -> Callable[[], int] | None:
  """glibc's count of the free bytes in its heaps (mallinfo2's fordblks), or None without it."""
  info = getattr(_libc(), "mallinfo2", None)
  if info is None:
    return None
  info.argtypes, info.restype = [], _MallInfo2
  return lambda: int(info().fordblks)


def _malloc_trim() -> Callable[[], object] | None:
  """glibc's malloc_trim(0) as a function of no argument, or None where there is none."""
  trim = getattr(_libc(), "malloc_trim", None)
  if trim is None:
    return None
  trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
  return lambda: trim(0)


class HeapTrimmer:
  """Trims the heap when asked, if `every_s` seconds have passed since it last looked (0: never)
  and the heaps hold at least `min_free_bytes` free (where the C library can say)."""

  def __init__(self, every_s: float, *, clock: Callable[[], float] = time.monotonic,
               trim: Callable[[], object] | None = None,
               free_bytes: Callable[[], int] | None = None,
               min_free_bytes: int | None = None):
    if every_s < 0:
      raise ValueError(f"every_s={every_s} must be >= 0 (0: never)")
    self._every_s = every_s
    self._clock = clock
    self._trim = trim if trim is not None else (_malloc_trim() if every_s > 0 else None)
    self._free_bytes = free_bytes if free_bytes is not None else (
        _free_heap_bytes() if every_s > 0 else None)
    self._min_free_bytes = MIN_FREE_BYTES if min_free_bytes is None else min_free_bytes
    self._last: float | None = None
    self.trims = 0
    self.seconds = 0.0  # wall seconds spent in the trims

  def maybe_trim(self) -> float | None:
    """Trims if it is time to: the wall seconds the trim took, None if it did not trim."""
    if self._every_s <= 0 or self._trim is None:
      return None
    now = self._clock()
    if self._last is not None and now - self._last < self._every_s:
      return None
    self._last = now
    if self._free_bytes is not None and self._free_bytes() < self._min_free_bytes:
      return None
    started = time.perf_counter()
    self._trim()
    seconds = time.perf_counter() - started
    self.seconds += seconds
    self.trims += 1
    return seconds
