"""Lost slices waited for (runtime/control/slice_watch.py): each on a thread of its own, which only
a check that finds the slice back ends. The runtime's side, a learner that loses its slice and
rejoins, is in tests/test_self_healing.py."""

import queue
import threading

from conftest import HandClock
from conftest import wait_until
from decoupled_diloco.runtime.control import slice_watch


def test_a_lost_slice_is_checked_on_a_thread_of_its_own_until_a_check_finds_it_back():
  answers = queue.Queue()  # each check waits for the test's next answer
  asked = []

  def slices_active(learner):
    asked.append(learner)
    answer = answers.get(timeout=60)
    if isinstance(answer, Exception):
      raise answer
    return answer

  clock = HandClock(now=1000.0)
  watch = slice_watch.SliceWatch(lambda error: False, slices_active, poll_s=0.0, clock=clock)
  watch.watch(3)  # returns while its first check waits: nobody else waits for a check
  assert watch.back_at(3) is None
  answers.put(False)  # still down
  answers.put(RuntimeError("the health check itself failed"))  # not back yet either
  clock.advance(5.0)
  answers.put(True)
  assert wait_until(lambda: watch.back_at(3) is not None)
  assert watch.back_at(3) == 1005.0 and asked == [3, 3, 3]
  watch.forget(3)  # it rejoined: a later loss is watched afresh
  assert watch.back_at(3) is None


def test_a_stopped_watch_checks_no_more():
  asked = []
  watch = slice_watch.SliceWatch(lambda error: False, lambda m: asked.append(m) or False,
                                 poll_s=3600.0)
  watch.watch(0)
  assert wait_until(lambda: asked == [0])
  watch.stop()  # the run is over: the wait ends at once instead of an hour later
  assert wait_until(lambda: all(t.name != "slice-watch-0" for t in threading.enumerate()))
  assert asked == [0] and watch.back_at(0) is None
