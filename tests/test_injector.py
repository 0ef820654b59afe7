"""The fault injector on its own: what a fault does to a learner's step path, on a fake clock."""

from typing import NamedTuple

import jax
import numpy as np
import pytest

from decoupled_diloco import chaos
from decoupled_diloco.runtime.faults import injector as injector_lib


class _State(NamedTuple):
  params: dict
  step: int


def _step(state, batch):
  del batch
  params = {n: v + 1.0 for n, v in state.params.items()}
  return _State(params, state.step + 1), {"loss": 1.0}


def _injector(schedule, clock=lambda: 100.0):
  injector = injector_lib.FaultInjector(chaos.parse_schedule(schedule, 2), None, 2, clock=clock)
  injector.start()
  return injector


def test_a_nan_fault_corrupts_the_output_of_that_learners_next_step_only():
  injector = _injector("nan@learner=1,step=3")
  assert injector.wrap_train_step(0, _step) is _step  # no nan fault scheduled: the step itself
  step = injector.wrap_train_step(1, _step)
  state = _State({"w": jax.numpy.zeros((2, 3)), "b": jax.numpy.zeros(4)}, 0)
  for s in range(5):
    injector.step_hook(1, s)
    state, _ = step(state, None)
    poisoned = {n: int(np.isnan(np.asarray(v)).sum()) for n, v in state.params.items()}
    # Before step 3 it fires; the state that step returns holds one NaN per tensor. A clean step
    # after it does not clear them (here: +1); it does not add more either.
    assert poisoned == ({"w": 1, "b": 1} if s >= 3 else {"w": 0, "b": 0}), s
    assert all(v.sharding == jax.numpy.zeros(1).sharding for v in state.params.values())
  [record] = injector.records
  assert (record["fault"], record["learner"], record["step"]) == ("nan", 1, 3)


def test_a_learner_whose_devices_never_failed_counts_as_repaired_before_any_time_read():
  """The supervisor compares repaired_at with a time it read first: a failure that took no device
  down (a non-finite loss) must not wait for a repair that never comes."""
  now = [100.0]
  injector = _injector("crash@learner=1,step=2,down_s=5", clock=lambda: now[0])
  assert injector.repaired_at(0) <= 0.0
  with pytest.raises(injector_lib.LearnerFailure):
    injector.step_hook(1, 2)
  assert injector.repaired_at(1) == 105.0


