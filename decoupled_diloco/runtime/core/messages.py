"""What travels between learners and the syncer (docs/design.md §3).

A learner reports metadata after every step and *publishes* its latest completed state: references to
its parameter arrays with, per fragment, the counters and anchor version that describe them. When a
fragment falls due the syncer takes that fragment from each learner's latest publication at once
(`LearnerLink.offer`): no round trip through the learner's step loop, and the copy to host RAM of the
one fragment starts then and runs while the learner computes. Merged fragments travel back as
`Broadcast`s.

Progress accounting: every offer covers the learner steps (since, step] of one fragment. A merge that
takes an offer makes those steps part of Theta_p; the syncer records, per learner and fragment, the
last step merged (`merged_through`) and takes a later offer only if it starts at or after that step,
so no step is ever merged twice, whatever the order in which broadcasts and pulls meet.

Incarnations: a learner that failed and was restarted (docs/design.md §6) keeps its index and counts
up its `incarnation`. Its step numbers start again from the peer state it rejoined from, so the
syncer keys its records by incarnation and drops whatever an earlier incarnation still sends or
offered.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from decoupled_diloco.algorithm import compression


@dataclasses.dataclass(frozen=True)
class StepReport:
  """Metadata after one inner step: no parameters."""

  learner: int
  step: int
  step_time_s: float
  tokens: int  # tokens of this step
  # Per fragment, the version of the Theta_p the learner holds (docs/design.md §3's per-fragment
  # metadata): tells the syncer which versions a learner may still be anchored at.
  anchor_versions: np.ndarray | None = None
  incarnation: int = 0  # which start of learner `learner` sent it (see the module docstring)


@dataclasses.dataclass(frozen=True)
class TrainingDone:
  """A learner made its last step; it keeps serving offers and taking merges (the final flush).

  Said again after each merge it applies since (and once a second): `anchor_versions` are the
  versions of Theta it holds then, as a step report's, so the delta broadcast keeps sending it
  deltas, not keyframes."""

  learner: int
  step: int
  incarnation: int = 0
  anchor_versions: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class LearnerExit:
  """A learner stopped: finished, stopped on request, or failed with `error`."""

  learner: int
  step: int
  error: str | None = None
  incarnation: int = 0


@dataclasses.dataclass(frozen=True)
class Publication:
  """A learner's latest completed state, as the syncer may take it (docs/design.md §3).

  Every field describes the same instant: the parameters after `step` with every merge applied that
  had arrived by then. Arrays are never written after publication (JAX arrays are immutable and the
  learner replaces its dicts, never mutates them), so a publication can be read from any thread.
  """

  step: int
  params: dict[str, Any]  # device arrays after `step`
  since: np.ndarray  # [P] the learner step where fragment p's unmerged progress starts
  counter_steps: np.ndarray  # [P] c_steps[m, p] = step - since
  counter_tokens: np.ndarray  # [P] c_tokens[m, p]
  anchor_versions: np.ndarray  # [P] version of the Theta_p the learner last received
  anchors: dict[str, np.ndarray]  # host copies of those Theta_p
  training: bool  # False once the learner made its last step
  # The rest of the train state at `step` (device arrays, never written): a rejoining learner
  # starts from a healthy peer's AdamW moments and step count (docs/design.md §6). None while a
  # learner with a donating step trains and nobody asked for them (`Learner.want_full_state`).
  opt_state: Any = None
  state_step: Any = None
  # The data loader's position at `step` (grain iterator state): the next batch is the one after
  # this step's. A checkpoint of the publication resumes the data exactly there.
  data_state: bytes | None = None
  # At the same instant: steps made by this incarnation and fragment-steps (tokens) the overwrite
  # on receive discarded. What the accounting keeps of a learner whose process is lost
  # (runtime/transport/ray_runtime.py): these, consistent with the counters above, not a later reading.
  steps_made: int = 0
  discarded_fragment_steps: int = 0
  discarded_fragment_tokens: int = 0
  # How many publications of the same `step` came before this one (merges applied after the
  # learner's last step, a repeat for a full state): with `step` it names the publication on the
  # event tape (runtime/records/event_tape.py).
  index: int = 0


@dataclasses.dataclass(frozen=True)
class Offer:
  """Learner m's fragment p as published after its step `step`, for the syncer to merge.

  `values` are the learner's device arrays (immutable, copying to host already); `anchor` is the host
  copy of the Theta_p the learner last received, version `anchor_version`. The counters are
  c_steps[m, p] and c_tokens[m, p] over the steps (since, step].

  An offer that crosses a network (a learner in a process of its own, runtime/transport/
  ray_runtime.py) carries its outer gradient already in the wire format instead (`encoded`, from
  `for_the_wire`): the bytes the syncer counts are then the bytes that travel, not the fp32 values
  and anchor, four times a bf16 outer gradient.
  """

  learner: int
  fragment: int
  step: int
  since: int
  steps: int
  tokens: int
  anchor_version: int
  values: dict[str, Any]
  anchor: dict[str, np.ndarray]
  incarnation: int = 0
  publication: int = 0  # the index of the publication it was taken from (Publication.index)
  # Delta_m of each tensor in the wire format, made where the learner runs; `values` and `anchor`
  # are then empty. None: the syncer computes Delta_m from them.
  encoded: dict[str, compression.Encoded] | None = None

  @property
  def fresh(self) -> bool:
    return self.steps > 0

  @property
  def in_host_memory(self) -> bool:
    """Whether the asynchronous copy has landed: the syncer pulls only from host RAM."""
    return all(v.is_ready() if hasattr(v, "is_ready") else True for v in self.values.values())

  @property
  def nbytes(self) -> int:
    """Host bytes the syncer holds for this offer once its copy has landed (fp32 values, or the
    encoded outer gradient)."""
    if self.encoded is not None:
      return compression.tree_nbytes(self.encoded)
    return sum(4 * int(np.prod(v.shape)) for v in self.values.values())

  def outer_gradient(self, name: str) -> np.ndarray:
    """Delta_m = anchor - theta_m of one tensor, float32."""
    if self.encoded is not None:
      return compression.decode(self.encoded[name])
    return self.anchor[name] - np.asarray(self.values[name], dtype=np.float32)

  def wire_outer_gradient(self, name: str, fmt: str, block_size: int) -> compression.Encoded:
    """Delta_m of one tensor in wire format `fmt`: the one it carries if it is in that format."""
    carried = (self.encoded or {}).get(name)
    if carried is not None and (carried.fmt, carried.block_size) == (fmt, block_size):
      return carried
    return compression.encode(self.outer_gradient(name), fmt, block_size)

  def for_the_wire(self, fmt: str, block_size: int) -> "Offer":
    """This offer carrying Delta_m in wire format `fmt` instead of its values and anchor (runs
    where the learner runs). A tensor whose Delta_m is not finite goes as fp32, which every value
    fits: the syncer's screen rejects it (runtime/core/global_model.py), where an integer format
    could not even encode it."""
    encoded = {}
    for name in sorted(self.values):
      delta = self.outer_gradient(name)
      encoded[name] = compression.encode(delta, fmt if np.all(np.isfinite(delta)) else "fp32",
                                         block_size)
    return dataclasses.replace(self, values={}, anchor={}, encoded=encoded)


class Answer(enum.Enum):
  """Why `LearnerLink.offer` returned no offer."""

  NOTHING = "nothing"  # the publication is current but holds no step on this fragment
  STALE = "stale"  # a merge of its earlier steps has not been applied yet: ask again later
  # No answer came back: the link to the learner is down (a partition, runtime/core/network.py). Not
  # an answer about the learner's state: ask again later.
  UNREACHABLE = "unreachable"


@dataclasses.dataclass(frozen=True)
class Broadcast:
  """A merged Theta_p, version `version`, as it travels to every live learner.

  With the delta broadcast (config.compression.broadcast_delta) `values` may instead be the change
  from the value of version `base_version` (R_p, `runtime/core/global_model.py`): only a learner whose
  anchor is that version may apply it, as anchor + decode(values); any other ignores it and gets a
  keyframe, a full value (`base_version` None), later.
  """

  fragment: int
  version: int
  values: dict[str, compression.Encoded]
  # learner -> step of its offer that this merge took in: the learner keeps (or, under the paper's
  # overwrite, drops) exactly the steps it made after that offer.
  merged_offers: dict[int, int] = dataclasses.field(default_factory=dict)
  base_version: int | None = None  # None: `values` are Theta_p itself (a keyframe)

  @property
  def nbytes(self) -> int:
    return sum(enc.nbytes for enc in self.values.values())


class PendingAnswer:
  """A learner's answer to a pull (`LearnerLink.offer`) still on its way from another process.

  The syncer keeps it among the copying offers of its round until `in_host_memory`, then reads
  `result()`: an `Offer` in host RAM or an `Answer`. The threaded runtime never makes one (its
  learners answer at once); `runtime/transport/ray_runtime.py` does.
  """

  @property
  def in_host_memory(self) -> bool:
    raise NotImplementedError

  def result(self) -> "Offer | Answer":
    raise NotImplementedError

