"""What travels between learners and the syncer (spec §3).

A learner reports metadata after every step, offers a fragment when the syncer pulls it (or, in the
lock-step modes, when its own schedule says so), and receives merged fragments. Offers carry device
array references whose copy to host RAM was started asynchronously; the syncer finishes the copy on its
own thread, so the learner's compute never waits for a pull.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from decoupled_diloco import compression


@dataclasses.dataclass(frozen=True)
class StepReport:
  """Metadata after one inner step: no parameters."""

  learner: int
  step: int
  step_time_s: float
  tokens: int  # tokens of this step


@dataclasses.dataclass(frozen=True)
class Offer:
  """Learner m's fragment p at one step, for the syncer to merge.

  `values` are the learner's device arrays at that step (immutable, copying to host already);
  `anchor` is the host copy of the Theta_p the learner last received, version `anchor_version`.
  The counters are c_steps[m, p] and c_tokens[m, p] since that receipt.
  """

  learner: int
  fragment: int
  step: int
  steps: int
  tokens: int
  anchor_version: int
  values: dict[str, Any]
  anchor: dict[str, np.ndarray]

  @property
  def fresh(self) -> bool:
    return self.steps > 0

  @property
  def in_host_memory(self) -> bool:
    """Whether the asynchronous copy has landed: the syncer pulls only from host RAM."""
    return all(v.is_ready() if hasattr(v, "is_ready") else True for v in self.values.values())

  def encode_outer_gradient(self, fmt: str, block_size: int) -> dict[str, compression.Encoded]:
    """Delta_m = anchor - theta_m, encoded in the wire format (runs on the learner's host CPU)."""
    return {
        name: compression.encode(
            self.anchor[name] - np.asarray(self.values[name], dtype=np.float32), fmt, block_size)
        for name in sorted(self.values)
    }


@dataclasses.dataclass(frozen=True)
class Broadcast:
  """A merged Theta_p, version `version`, as it travels to every live learner."""

  fragment: int
  version: int
  values: dict[str, compression.Encoded]
  # learner -> step of its offer that this merge took in; lets a learner with
  # keep_in_flight_progress re-apply the steps it made after that offer.
  merged_offers: dict[int, int] = dataclasses.field(default_factory=dict)

  @property
  def nbytes(self) -> int:
    return sum(enc.nbytes for enc in self.values.values())


@dataclasses.dataclass(frozen=True)
class LearnerExit:
  """A learner stopped: finished, stopped on request, or failed with `error`."""

  learner: int
  step: int
  error: str | None = None
