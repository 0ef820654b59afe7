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
  # A learner that finished, with no step and no other merge of p since the offer this merge took:
  # nothing is in flight, and it ends holding Theta_p itself. (The rebase would give the same in
  # reals; in float32 it leaves theta_now as it is where Theta_p hands the offer back, as the
  # identity outer step does, which is what keeps a learner on dp's steps while it trains.)
  caught_up = (learner._finished and taken is not None and taken.step == learner.step
               and taken.anchor_version == learner._anchor_versions[p])
  params = learner._state.params
  anchors, updates = dict(learner._anchors), {}
  for name, encoded in broadcast.values.items():
    theta_global = compression.decode(encoded)
    if broadcast.base_version is not None:
      # The anchor is R_p at the base version: the same float32 sum as the syncer's new R_p.
      theta_global = learner._anchors[name] + theta_global
    now = learner._layout.get(params, name)
    offered = offer_anchor = moved = None
    if keep and taken is not None and not caught_up:
      # The merge took this learner's steps up to the offer: keep those after it.
      offered, offer_anchor = taken.values[name], taken.anchor[name]
      if taken.anchor_version != learner._anchor_versions[p]:
        moved = (learner._anchors[name], taken.anchor[name])
    elif keep and taken is None:
      # None of the unmerged steps is in this merge: keep them all (against the anchor, which
      # A - (A - A) leaves as it is: the same program as above).
      offered = offer_anchor = learner._anchors[name]
    updates[name] = receive_lib.receive(
        theta_global, now, alpha=learner._options.alpha, sharding=learner._flat_shardings[name],
        offered=offered, offer_anchor=offer_anchor, anchors=moved,
        gather=host_array if learner._finished else None)
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
