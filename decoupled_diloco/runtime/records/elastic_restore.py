"""A job checkpoint restored onto another number of learners, or onto other learner meshes.

An elastic run loses and gains slices by design, and a job may come back on another chip count
(maxtext #2537). A checkpoint of M learners resumes as M' learners:

- learners 0..min(M, M')-1 keep their own state: step, train state, counters, anchors, and their
  data position (the count of windows read, in their shard of M' now: `data.reshard_position`);
- learners M..M'-1 (M' > M) start as a rejoining learner does (docs/design.md §6,
  `job_state.rejoin_cut`): the syncer's Theta as parameters and anchors, the optimizer state and
  step of the most advanced kept learner, counters at 0, and their data from the start of their own
  shard, as any learner that has read nothing yet;
- learners M'..M-1 (M' < M) are dropped: their steps stay in the token account
  (`tokens_trained`), as a learner that departed and never came back counts;
- the syncer's state (Theta, the outer optimizer's, versions, the grace estimator) carries over;
  what it keeps per learner is kept for the learners that remain.

A learner's mesh may change shape as well: the checkpoint holds host arrays, and each learner
places its state with its own mesh's shardings (`learner_restart.restore`), as a rejoiner's is placed.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any


from decoupled_diloco import settings as settings_lib
from decoupled_diloco.errors import InputError
from decoupled_diloco.lm import data as data_lib
from decoupled_diloco.runtime.records import checkpoints

# History fields with one entry per learner (`Checkpointer._history`, checkpoint_cadence.py).
_PER_LEARNER = ("steps_made", "discarded_fragment_steps", "discarded_fragment_tokens",
                "incarnations", "start_steps", "restarts", "barrier_wait_seconds")


@dataclasses.dataclass(frozen=True)
class Change:
  """What a restore changes against the run that wrote the checkpoint."""

  old_learners: int
  new_learners: int
  old_meshes: tuple[tuple[int, ...], ...]
  new_meshes: tuple[tuple[int, ...], ...]

  @property
  def dropped(self) -> tuple[int, ...]:
    return tuple(range(self.new_learners, self.old_learners))

  @property
  def joining(self) -> tuple[int, ...]:
    return tuple(range(self.old_learners, self.new_learners))

  @property
  def reshaped(self) -> tuple[int, ...]:
    """Kept learners whose mesh has another shape."""
    return tuple(m for m in range(min(self.old_learners, self.new_learners))
                 if self.old_meshes[m] != self.new_meshes[m])

  def __bool__(self) -> bool:
    return self.old_learners != self.new_learners or bool(self.reshaped)

  def describe(self, peer: int | None = None) -> str:
    """The one log line: what the restore changes."""
    parts = []
    if self.dropped:
      parts.append(f"learners {_span(self.dropped)} dropped (their steps stay in the token "
                   "account)")
    if self.joining:
      parts.append(f"learners {_span(self.joining)} start from the global model and learner "
                   f"{peer}'s optimizer state")
    if self.reshaped:
      parts.append("meshes " + ", ".join(
          f"learner {m} {self.old_meshes[m]} -> {self.new_meshes[m]}" for m in self.reshaped))
    return (f"restoring a {self.old_learners}-learner checkpoint onto {self.new_learners} "
            f"learner(s): " + "; ".join(parts))

  def to_json(self) -> dict[str, Any]:
    return {"from_learners": self.old_learners, "to_learners": self.new_learners,
            "dropped": list(self.dropped), "joining": list(self.joining),
            "reshaped": {str(m): [list(self.old_meshes[m]), list(self.new_meshes[m])]
                         for m in self.reshaped}}


def change(restored: checkpoints.RestoredCheckpoint,
           settings: settings_lib.RunSettings) -> Change | None:
  """How `settings` differ from the checkpoint's run in learners and meshes (None: not at all, or
  a checkpoint that does not say). Raises InputError for a change a restore cannot make."""
  theirs = restored.fingerprint
  if "num_learners" not in theirs or "learner_mesh_shapes" not in theirs:
    return None
  found = Change(old_learners=int(ast.literal_eval(theirs["num_learners"])),
                 new_learners=settings.num_learners,
                 old_meshes=tuple(tuple(s) for s in ast.literal_eval(theirs["learner_mesh_shapes"])),
                 new_meshes=settings.learner_mesh_shapes)
  if not found:
    return None
  if settings.mode == "dp":
    # The one dp learner's batch is num_learners x data.batch_size over all learner devices:
    # another device count is another batch, not the same job resumed.
    raise InputError(f"config.learner_mesh_shapes={settings.learner_mesh_shapes} (and "
                     f"config.num_learners) must be the checkpoint's in dp mode: "
                     f"{restored.path} was written on {found.old_meshes}, and a dp job's batch "
                     "spans every learner device")
  if found.old_learners != found.new_learners:
    if settings.runtime != "threads":
      raise InputError(f"config.num_learners={found.new_learners}: {restored.path} holds "
                       f"{found.old_learners} learners, and restoring onto another number runs "
                       f"with config.runtime='threads' only so far (not {settings.runtime!r})")
    if settings.late_learners:
      raise InputError(f"config.late_learners={settings.late_learners} must be () to restore "
                       f"the {found.old_learners}-learner checkpoint {restored.path} onto "
                       f"{found.new_learners} learners (a late learner's join is not rescheduled)")
  return found


def adapt(restored: checkpoints.RestoredCheckpoint, found: Change,
          tokens_per_step: int) -> None:
  """Makes `restored` a checkpoint of `found.new_learners` learners, in place (before the run is
  built from it). `tokens_per_step`: of one dropped learner (one batch size for all)."""
  cut, old, new = restored.cut, found.old_learners, found.new_learners
  if old == new:
    return
  history = cut.history
  held = {l.index: int(sum(l.counter_tokens)) for l in cut.learners}
  # What each dropped learner did, for the token accounts: its steps, its fragment-tokens the
  # overwrite on receive discarded, and those it held unmerged at the cut (lost with it, as a
  # failed learner's are). A learner down at the cut holds none: its failure counted them.
  dropped = [{"learner": m, "steps_made": int(history["steps_made"][m]),
              "tokens": int(history["steps_made"][m]) * tokens_per_step,
              "discarded_fragment_tokens": int(history["discarded_fragment_tokens"][m]),
              "unmerged_fragment_tokens": held.get(m, 0)} for m in found.dropped]
  history["dropped_learners"] = list(history.get("dropped_learners", [])) + dropped
  cut.learners = [l for l in cut.learners if l.index < new]
  for learner in cut.learners:
    if learner.data_state is not None:
      learner.data_state = data_lib.reshard_position(
          learner.data_state, shard_index=learner.index, old_num_shards=old, new_num_shards=new)
  absent = {}
  for key, state in history.get("absent_data", {}).items():
    if int(key) < new and state:
      absent[key] = data_lib.reshard_position(
          state.encode(), shard_index=int(key), old_num_shards=old, new_num_shards=new).decode()
  history["absent_data"] = absent
  for key in _PER_LEARNER:
    if key in history:
      values = list(history[key])[:new]
      # A joining learner has made no step of its own; `incarnations` -1 makes its first 0.
      history[key] = values + [-1 if key == "incarnations" else 0] * (new - len(values))
  if cut.syncer is not None:
    cut.syncer = {"arrays": cut.syncer["arrays"], "json": _syncer_json(cut.syncer["json"], new)}


def _syncer_json(values: dict[str, Any], num_learners: int) -> dict[str, Any]:
  """The syncer's JSON state without what it kept of learners that no longer exist (a sharded
  syncer's: each shard's)."""
  if "shards" in values:
    return {**values, "shards": [_syncer_json(shard, num_learners) for shard in values["shards"]]}
  values = dict(values)
  values["merged_through"] = [e for e in values["merged_through"] if int(e[0]) < num_learners]
  for key in ("learner_steps", "incarnations", "reported_anchors"):
    values[key] = {m: v for m, v in values.get(key, {}).items() if int(m) < num_learners}
  grace = dict(values["grace"])
  grace["step_times"] = [e for e in grace["step_times"] if int(e[0]) < num_learners]
  values["grace"] = grace
  return values


def _span(learners: tuple[int, ...]) -> str:
  return (f"{learners[0]}-{learners[-1]}" if len(learners) > 2
          else ", ".join(str(m) for m in learners))
