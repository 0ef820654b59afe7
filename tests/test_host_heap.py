"""The syncer hands the freed C heap back to the OS after merges (runtime/core/host_heap.py)."""

import sys
import threading

import numpy as np
import pytest

from conftest import tiny_settings
from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.core import host_heap


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_trims_at_most_once_per_interval():
  clock, calls = _Clock(), []
  heap = host_heap.HeapTrimmer(5.0, clock=clock, trim=lambda: calls.append(clock.now),
                               free_bytes=lambda: host_heap.MIN_FREE_BYTES)
  for now in (0.0, 1.0, 4.9, 5.0, 9.0, 10.1, 30.0):
    clock.now = now
    heap.maybe_trim()
  assert calls == [0.0, 5.0, 10.1, 30.0]
  assert heap.trims == 4 and heap.seconds >= 0


def test_no_trim_while_the_heaps_hold_little_free():
  clock, calls, free = _Clock(), [], [10]
  heap = host_heap.HeapTrimmer(5.0, clock=clock, trim=lambda: calls.append(clock.now),
                               free_bytes=lambda: free[0], min_free_bytes=100)
  heap.maybe_trim()  # 10 free: no trim, and the next look is 5 s later
  clock.now, free[0] = 1.0, 500
  heap.maybe_trim()
  clock.now = 5.0
  heap.maybe_trim()
  assert calls == [5.0]


def test_zero_never_trims_and_a_negative_interval_is_refused():
  calls = []
  heap = host_heap.HeapTrimmer(0.0, trim=lambda: calls.append(1))
  assert heap.maybe_trim() is None and not calls
  with pytest.raises(ValueError, match="every_s=-1"):
    host_heap.HeapTrimmer(-1.0)


def _resident_bytes() -> int:
  with open("/proc/self/status", encoding="utf-8") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) * 1024
  raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_heap._malloc_trim() is None,  # pylint: disable=protected-access
                    reason="glibc's malloc_trim")
def test_a_trim_gives_back_the_heap_a_thread_freed():
  """What glibc keeps: after one large block freed, blocks of a few MB come from a thread's heap;
  freed, they stay resident until a trim."""
  kept = {}

  def churn():
    big = np.ones(8 << 20, np.uint8)
    del big  # raises glibc's threshold for mapping a block on its own
    blocks = [np.ones(4 << 20, np.uint8) for _ in range(48)]  # 192 MB from the heap
    kept["top"] = np.ones(4096, np.uint8)  # above them: the heap cannot just shrink
    del blocks

  thread = threading.Thread(target=churn)
  thread.start()
  thread.join()
  before = _resident_bytes()
  assert host_heap.HeapTrimmer(1.0, min_free_bytes=150 << 20).maybe_trim() is not None
  assert before - _resident_bytes() > 150 << 20


def test_the_syncer_trims_after_its_merges(tmp_path, monkeypatch):
  monkeypatch.setattr(host_heap, "MIN_FREE_BYTES", 0)  # a tiny run's heaps hold little
  run = train.build(tiny_settings(tmp_path, num_steps=24, syncer__heap_trim_every_s=1e-9))
  summary = train.execute(run, progress=False)
  assert summary["merges"] > 0
  assert summary["syncer_heap_trims"] == summary["merges"]
  assert summary["syncer_heap_trim_seconds"] > 0
