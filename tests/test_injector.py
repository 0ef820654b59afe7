"""The fault injector on its own: what a fault does to a learner's step path, on a fake clock."""

import pytest

from decoupled_diloco.runtime import chaos
from decoupled_diloco.runtime import injector as injector_lib


def _injector(schedule, clock=lambda: 100.0):
  injector = injector_lib.FaultInjector(chaos.parse_schedule(schedule, 2), None, 2, clock=clock)
  injector.start()
  return injector


def test_a_learner_whose_devices_never_failed_counts_as_repaired_before_any_time_read():
  """The supervisor compares repaired_at with a time it read first: a failure that took no device
  down (a non-finite loss) must not wait for a repair that never comes."""
  now = [100.0]
  injector = _injector("crash@learner=1,step=2,down_s=5", clock=lambda: now[0])
  assert injector.repaired_at(0) <= 0.0
  with pytest.raises(injector_lib.LearnerFailure):
    injector.step_hook(1, 2)
  assert injector.repaired_at(1) == 105.0
