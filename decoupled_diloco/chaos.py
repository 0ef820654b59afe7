r"""Faults to inject: `config.chaos.schedule` and random crashes (docs/failures.md).

Pure: this module parses and checks the schedule text and draws random crashes from a seed. It
does not inject anything: the runtime fires each fault through the path a real failure takes (a
crash is an exception in the learner's step path), so recovery code never knows a fault was made up.

The schedule is one string, so that it can be given on the command line: `;`-separated events,
each `KIND@key=value,key=value`:

  crash@learner=M,step=S,down_s=D            learner M fails before step S, repaired D s later;
                                             its device state counts as lost
  hang@learner=M,step=S,seconds=T            stops stepping for T s, then goes on with its old state
  slow@learner=M,step=S,factor=F,seconds=T   its steps take F times as long for T s
  partition@learner=M,step=S,seconds=T       nothing reaches or leaves it for T s; it keeps training
  nan@learner=M,step=S                       its parameters hold a NaN from step S on
  join@learner=M,second=T                    a learner held back at start (config.late_learners)
                                             joins T s into training
  syncer_crash@second=T,down_s=D             the syncer's state is lost; restarted D s later
  syncer_crash@shard=I,second=T,down_s=D     the same for shard I of a sharded syncer
                                             (config.syncer.num_shards); without shard= every
                                             shard crashes (the whole syncer's state is lost)
  corrupt_checkpoint@second=T                the newest checkpoint on disk is damaged
  node_loss@learner=M,step=S                 the Ray node (host) of learner M is lost with every
                                             process on it; Ray restarts the learner on a spare
  node_loss@syncer,second=T                  the syncer's host is lost; restored on a spare
                                             (shard=I: shard I's host; without: every shard's)

A learner event fires before a given step of that learner (`step=`) or at a time into training
(`second=`): exactly one of the two. Random mode adds crashes at exponential intervals of mean
`mtbf_s` per learner, each repaired after a Weibull time of mean `repair_s` (the simulator's model,
`sim/cluster.py`); the two sources combine. With `node_loss_fraction` > 0 that share of the random
faults are node losses instead (a seeded draw of its own: the fault times stay the same).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence

import numpy as np

FIELD = "config.chaos.schedule"


@dataclasses.dataclass(frozen=True)
class _Kind:
  target: str  # "learner" (learner=M and step= or second=), "syncer" / "checkpoint" (second=)
  durations: tuple[str, ...]  # keys that must be given, besides the target and the trigger
  step_trigger: bool = True  # a learner event may fire at one of its steps


KINDS = {
    "crash": _Kind("learner", ("down_s",)),
    "hang": _Kind("learner", ("seconds",)),
    "slow": _Kind("learner", ("factor", "seconds")),
    "partition": _Kind("learner", ("seconds",)),
    "nan": _Kind("learner", ()),
    "join": _Kind("learner", (), step_trigger=False),
    "syncer_crash": _Kind("syncer", ("down_s",)),
    "corrupt_checkpoint": _Kind("checkpoint", ()),
    # A learner's host (learner=M) or, written node_loss@syncer,second=T, the syncer's.
    "node_loss": _Kind("learner", ()),
}
NODE_LOSS = "node_loss"


@dataclasses.dataclass(frozen=True)
class Fault:
  """One fault to inject. Times are seconds into training (after the build)."""

  kind: str
  learner: int | None = None  # None for syncer and checkpoint faults
  # A syncer fault's shard of a sharded syncer (config.syncer.num_shards); None: every shard (an
  # unsharded syncer is one).
  shard: int | None = None
  step: int | None = None  # fires before this step of the learner ...
  second: float | None = None  # ... or at this time
  down_s: float = 0.0  # crash, syncer_crash: until the repair
  seconds: float = 0.0  # hang, slow, partition: how long it lasts
  factor: float = 1.0  # slow: step time multiplier
  source: str = ""  # the event as written, or "random"

  def due(self, step: int, elapsed_s: float) -> bool:
    """Whether the fault fires at a learner's step boundary `step`, `elapsed_s` into training."""
    if self.step is not None:
      return step >= self.step
    return elapsed_s >= self.second


def _error(index: int, event: str, message: str) -> ValueError:
  return ValueError(f"{FIELD} event {index} ({event!r}): {message}")


def _number(index: int, event: str, key: str, text: str, *, integer: bool) -> float | int:
  try:
    value = int(text) if integer else float(text)
  except ValueError:
    kind = "an integer" if integer else "a number"
    raise _error(index, event, f"{key}={text!r} must be {kind}") from None
  if not math.isfinite(value) or value < 0:
    raise _error(index, event, f"{key}={text} must be >= 0")
  return value


def _parse_event(index: int, event: str, num_learners: int) -> Fault:
  kind_name, at, body = event.partition("@")
  kind_name = kind_name.strip()
  if kind_name not in KINDS:
    raise _error(index, event, f"unknown kind {kind_name!r}; known kinds: {', '.join(KINDS)}")
  if not at or not body.strip():
    raise _error(index, event, f"needs keys after '@', e.g. {kind_name}@key=value,key=value")
  kind = KINDS[kind_name]
  items = [item.strip() for item in body.split(",")]
  if kind_name == NODE_LOSS and "syncer" in items:  # the syncer's host: at a time only
    kind = _Kind("syncer", ())
    items.remove("syncer")
    if not items:
      raise _error(index, event, "node_loss@syncer needs second= (when it happens)")
  allowed = set(kind.durations) | {"second"}
  if kind.target == "syncer":
    allowed |= {"shard"}
  if kind.target == "learner":
    allowed |= {"learner"} | ({"step"} if kind.step_trigger else set())
  values: dict[str, str] = {}
  for item in items:
    key, eq, text = (part.strip() for part in item.partition("="))
    if not eq or not key or not text:
      raise _error(index, event, f"{item.strip()!r} is not key=value")
    if key not in allowed:
      also = " (or node_loss@syncer,second=T)" if kind_name == NODE_LOSS else ""
      raise _error(index, event, f"{kind_name} takes no key {key!r}; it takes "
                                 f"{', '.join(sorted(allowed))}{also}")
    if key in values:
      raise _error(index, event, f"{key} is given twice")
    values[key] = text
  missing = [k for k in kind.durations if k not in values]
  if kind.target == "learner" and "learner" not in values:
    missing.insert(0, "learner" if kind_name != NODE_LOSS else "learner= (or syncer)")
  if missing:
    raise _error(index, event, f"{kind_name} needs {', '.join(missing)}")
  fields: dict = {"kind": kind_name, "source": event}
  if kind.target == "learner":
    learner = _number(index, event, "learner", values["learner"], integer=True)
    if learner >= num_learners:
      raise _error(index, event, f"learner={learner} is out of range: the run has learners "
                                 f"0..{num_learners - 1}")
    fields["learner"] = learner
  if "shard" in values:
    fields["shard"] = _number(index, event, "shard", values["shard"], integer=True)
  triggers = [k for k in ("step", "second") if k in values]
  if len(triggers) != 1:
    needed = "one of step= or second=" if "step" in allowed else "second="
    raise _error(index, event, f"{kind_name} needs {needed} (when it happens)")
  if triggers == ["step"]:
    fields["step"] = _number(index, event, "step", values["step"], integer=True)
  else:
    fields["second"] = _number(index, event, "second", values["second"], integer=False)
  for key in kind.durations:
    fields[key] = _number(index, event, key, values[key], integer=False)
  if kind_name in ("hang", "slow", "partition") and not fields["seconds"] > 0:
    raise _error(index, event, f"seconds={values['seconds']} must be > 0")
  if kind_name == "slow" and not fields["factor"] >= 1:
    raise _error(index, event, f"factor={values['factor']} must be >= 1 (a step takes factor "
                               "times as long)")
  return Fault(**fields)


def parse_schedule(text: str, num_learners: int) -> tuple[Fault, ...]:
  """The faults a schedule string names, in the order written; errors name the event."""
  if not isinstance(text, str):
    raise ValueError(f"{FIELD}={text!r} must be a string of ';'-separated events")
  events = [event.strip() for event in text.split(";")]
  if events == [""]:
    return ()
  faults = []
  for index, event in enumerate(events):
    if not event:
      raise ValueError(f"{FIELD}={text!r}: event {index} is empty (a stray ';')")
    faults.append(_parse_event(index, event, num_learners))
  return tuple(faults)


def check_within_run(faults: Sequence[Fault], num_steps: int) -> None:
  """Every step-triggered fault fires: a learner's last step is num_steps - 1, and a fault set
  for a later one would pass unnoticed, the run reporting a resilience it was never asked for.
  (A `second=` fault past the end cannot be known at start-up: the run's length in time is not.)"""
  for index, fault in enumerate(faults):
    if fault.step is not None and fault.step >= num_steps:
      raise _error(index, fault.source, f"step={fault.step} is never reached: the run's last "
                                        f"step is {num_steps - 1} (config.num_steps={num_steps})")


def check_shards(faults: Sequence[Fault], num_shards: int) -> None:
  """A syncer fault's shard= names a shard the syncer has."""
  for index, fault in enumerate(faults):
    if fault.shard is not None and fault.shard >= num_shards:
      raise _error(index, fault.source, f"shard={fault.shard} is out of range: "
                                        f"config.syncer.num_shards={num_shards} has shard(s) "
                                        f"0..{num_shards - 1}")


def check_joins(faults: Sequence[Fault], late_learners: Sequence[int]) -> None:
  """Each late learner joins exactly once, and only late learners join."""
  joins = [f.learner for f in faults if f.kind == "join"]
  for fault in faults:
    if fault.kind == "join" and fault.learner not in late_learners:
      raise ValueError(f"{FIELD} event {fault.source!r}: learner {fault.learner} is not in "
                       f"config.late_learners={tuple(late_learners)}, so it is already running")
  for learner in late_learners:
    if joins.count(learner) != 1:
      raise ValueError(f"config.late_learners holds {learner}, so {FIELD} needs exactly one "
                       f"join@learner={learner},second=T (it has {joins.count(learner)})")


@dataclasses.dataclass(frozen=True)
class RandomCrashes:
  """Crashes at exponential intervals of mean `mtbf_s` per learner, Weibull repairs (sim's model).

  The draws depend only on (seed, learner): the same config injects the same crashes whatever the
  run's timing. A learner's next failure is drawn from when its repair ends.
  """

  mtbf_s: float
  repair_s: float
  repair_shape: float
  seed: int
  node_loss_fraction: float = 0.0  # the share of them that are node losses (runtime=ray)

  def __post_init__(self):
    for name in ("mtbf_s", "repair_s"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"config.chaos.{name}={value!r} must be a number >= 0 "
                         "(mtbf_s=0: no random crashes)")
    if (isinstance(self.node_loss_fraction, bool) or
        not isinstance(self.node_loss_fraction, (int, float)) or
        not 0 <= self.node_loss_fraction <= 1):
      raise ValueError(f"config.chaos.node_loss_fraction={self.node_loss_fraction!r} must be a "
                       "number in [0, 1] (the share of random faults that are node losses)")
    if not self.repair_shape > 0:
      raise ValueError(f"config.chaos.repair_shape={self.repair_shape!r} must be > 0 "
                       "(1 = exponential repairs; larger = more regular)")

  @property
  def enabled(self) -> bool:
    return self.mtbf_s > 0

  def crashes(self, learner: int) -> Iterator[Fault]:
    """Learner `learner`'s crashes in time order (endless; empty when random mode is off)."""
    if not self.enabled:
      return
    rng = np.random.default_rng([self.seed, learner])
    kinds = np.random.default_rng([self.seed, learner, 1])  # which are node losses
    unit_mean = 1.0 / math.gamma(1.0 + 1.0 / self.repair_shape)
    t = 0.0
    while True:
      t += float(rng.exponential(self.mtbf_s))
      down = self.repair_s * unit_mean * float(rng.weibull(self.repair_shape))
      if self.node_loss_fraction and kinds.random() < self.node_loss_fraction:
        # Down until Ray has restarted it on a spare host: the drawn time only spaces the next.
        yield Fault(NODE_LOSS, learner=learner, second=t, source="random")
      else:
        yield Fault("crash", learner=learner, second=t, down_s=down, source="random")
      t += down
