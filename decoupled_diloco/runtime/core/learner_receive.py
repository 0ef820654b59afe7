"""A merged Theta_p applied to a learner: which of its steps the merge took in, and what it keeps.

A broadcast names the offer of each learner it merged (runtime/core/learner_ledger.py keeps the
offers taken), which tells the learner exactly which of its steps are now in Theta_p. The rule,
with Streaming DiLoCo's alpha mix, is algorithm/receive.py:

- overwrite (the paper, alpha = 0): theta_p <- Theta_p; the steps made since the merged offer are
  dropped (counted in `discarded_fragment_steps`);
- keep_in_flight_progress: theta_p <- Theta_p + (the steps not merged yet), so no step is lost. A
  learner that made its last step always keeps them: nothing would replace them, and the final flush
  merges them.

With the delta broadcast (runtime/core/global_model.py) a broadcast may carry only the change from
the anchor of version `base_version`, which the learner adds to its anchor when it holds that
version and ignores otherwise. This is a part of the learner's step boundary
(runtime/core/learner.py), on its thread and its state.
"""

from __future__ import annotations

from typing import Any

from decoupled_diloco.algorithm import compression
from decoupled_diloco.algorithm import receive as receive_lib
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core.agreement import host_array

# pylint: disable=protected-access


def apply(learner: Any, broadcast: messages.Broadcast) -> None:
  """Applies the merge of fragment `broadcast.fragment` to `learner`'s parameters and counters."""
  p = broadcast.fragment
  if broadcast.version <= learner._anchor_versions[p]:
    return  # broadcasts apply monotonically: an older Theta_p never overwrites a newer one
  if broadcast.base_version is not None and broadcast.base_version != learner._anchor_versions[p]:
    # A delta against a value this learner does not hold (it missed a broadcast): it would
    # reconstruct a wrong Theta_p. The syncer sends a keyframe once it sees this version held.
    learner.ignored_deltas += 1
    return
  merged_step = broadcast.merged_offers.get(learner.index)
  with learner._lock:  # one section with the tape's event: ordered against the syncer's takes
    learner._tape.event("apply", fragment=p, version=broadcast.version, step=learner.step,
                        publications=learner._published.index + 1
                        if learner._published.step == learner.step else 0, merged=merged_step)
    taken, unknown = learner._ledger.merged(p, merged_step, learner._since[p])
  keep = (learner._options.keep_in_flight_progress or learner._finished) and not unknown
  params = learner._state.params
  anchors, updates = dict(learner._anchors), {}
  for name, encoded in broadcast.values.items():
    theta_global = compression.decode(encoded)
    if broadcast.base_version is not None:
      # The anchor is R_p at the base version: the same float32 sum as the syncer's new R_p.
      theta_global = learner._anchors[name] + theta_global
    now = learner._layout.get(params, name)
    offered = moved = None
    if keep and taken is not None:
      # The merge took this learner's steps up to the offer: keep those after it.
      offered = taken.values[name]
      if taken.anchor_version != learner._anchor_versions[p]:
        moved = (learner._anchors[name], taken.anchor[name])
    elif keep:
      offered = learner._anchors[name]  # none of the unmerged steps is in this merge: keep them all
    updates[name] = receive_lib.receive(
        theta_global, now, alpha=learner._options.alpha, sharding=learner._flat_shardings[name],
        offered=offered, anchors=moved, gather=host_array if learner._finished else None)
    anchors[name] = theta_global
  learner._state = learner._state._replace(params=learner._layout.set(params, updates))
  learner._anchors = anchors
  learner._anchor_versions[p] = broadcast.version
  if keep:
    if taken is not None:
      learner._counter_steps[p] -= taken.steps
      learner._counter_tokens[p] -= taken.tokens
      learner._since[p] = taken.step
  else:
    merged_steps = taken.steps if taken is not None else 0
    merged_tokens = taken.tokens if taken is not None else 0
    learner._ledger.discard(int(learner._counter_steps[p]) - merged_steps,
                            int(learner._counter_tokens[p]) - merged_tokens)
    learner._counter_steps[p] = 0
    learner._counter_tokens[p] = 0
    learner._since[p] = learner.step
