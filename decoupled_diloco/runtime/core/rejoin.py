"""The state a restarted learner starts from (docs/design.md §6, rejoin).

The supervisor makes a new incarnation from it (`runtime/control/supervisor.py`), and a replay makes
the same one from the recorded event (`runtime/records/event_tape.py`), so both build it here: Theta
as the learners received it, a healthy peer's optimizer state and step, no unmerged progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from decoupled_diloco.lm import inner
from decoupled_diloco.runtime.core import learner_state
from decoupled_diloco.runtime.core import messages


def rejoin_snapshot(theta: dict[str, np.ndarray], versions: np.ndarray,
                    layout, published: messages.Publication | None, failed_step: int,
                    init_opt_state: Callable[[Any], Any], offers_made: np.ndarray | None
                    ) -> learner_state.LearnerSnapshot:
    """A restarted learner's state (docs/design.md §6): Theta as the learners received it (`theta`,
    at `versions`), a healthy peer's optimizer state and step from its publication (`published`;
    None: fresh optimizer state at the failed learner's step), no unmerged progress. Its loader
    keeps its own position. A replay (runtime/records/event_tape.py) makes it the same way."""
    params = layout.to_native(theta)
    if published is not None:
      step, opt_state, state_step = published.step, published.opt_state, published.state_step
    else:
      step = failed_step
      opt_state, state_step = init_opt_state(params), np.int32(step)
    num_fragments = len(versions)
    return learner_state.LearnerSnapshot(
        step=step,
        train_state=inner.TrainState(params=params, opt_state=opt_state, step=state_step),
        data_state=None,  # the loader keeps its own position
        counter_steps=np.zeros(num_fragments, np.int64),
        counter_tokens=np.zeros(num_fragments, np.int64),
        since=np.full(num_fragments, step, np.int64),
        anchors=theta, anchor_versions=versions,
        # Lock-step: the barrier the peer waits at is its barrier too.
        offers_made=offers_made)
