"""A partition between one learner and the syncer, in the real runtime (a `partition` fault).

For T seconds nothing reaches or leaves the learner: the syncer finds it silent (heartbeats) and
merges without it, it trains on, and once the link is back its next report takes it back and the
syncer sends it every Theta_p it missed. Nothing is lost silently: every token is still merged,
discarded, lost or unmerged.
"""

import threading
import time

from conftest import tiny_settings
from decoupled_diloco.runtime.core import messages
from decoupled_diloco.runtime.core import metrics as metrics_lib
from decoupled_diloco.runtime.core import network as network_lib
from decoupled_diloco.runtime import train

M, S, SECONDS = 1, 6, 1.5  # partition@learner=M,step=S,seconds=SECONDS


class _Log:
  """Thread-safe (time, ...) events."""

  def __init__(self):
    self.events = []
    self._lock = threading.Lock()

  def add(self, *event):
    with self._lock:
      self.events.append((time.monotonic(), *event))


class _HeldNetworkClock:
  """The network's clock: real time, except that it stands just short of the partition's end
  until `done()` holds (a minute at most). The partition then lasts as long as the test needs
  (learner M stepping on, the others merging, the heartbeat finding M absent) however slowly the
  host runs the threads. `healed_at`: when the network first read its end, i.e. healed."""

  def __init__(self, network, done, give_up_after_s=60.0):
    self._done = done
    self._give_up_at = time.monotonic() + give_up_after_s
    self._end = None
    self._released = False
    self.healed_at = None
    partition = network.partition

    def held_partition(learner, seconds, record):
      self._end = time.monotonic() + seconds
      partition(learner, seconds, record)

    network.partition = held_partition
    network._clock = self  # pylint: disable=protected-access

  def __call__(self):
    now = time.monotonic()
    if self._end is None:
      return now
    if not self._released:
      self._released = self._done() or now > self._give_up_at
    if not self._released:
      return min(now, self._end - 1e-3)
    if now >= self._end and self.healed_at is None:
      self.healed_at = now
    return now


def test_a_partitioned_learner_trains_on_is_merged_without_and_catches_up_when_it_heals(tmp_path):
  steps, installs, received = _Log(), _Log(), _Log()
  run = train.build(
      tiny_settings(tmp_path, chaos__schedule=f"partition@learner={M},step={S},seconds={SECONDS}",
                    sync__heartbeat_timeout_s=0.3, sync__num_fragments=8, sync__period=8,
                    num_steps=48, learner_step_delays_s=(0.05,) * 4),
      step_hook=lambda learner, step: steps.add(learner, step))
  install = run.syncer.model.install

  def logged_install(result, anchored=()):
    version = install(result, anchored)
    installs.add(result.fragment, version)
    return version

  run.syncer.model.install = logged_install
  learner = run.learners[M]
  deliver = learner.deliver
  # What reaches the learner, past the partitioned link (the syncer holds that link, not this).
  learner.deliver = lambda broadcast: (received.add(broadcast.fragment, broadcast.version),
                                       deliver(broadcast))

  def partition_began():
    return [t for t, m, step in steps.events if (m, step) == (M, S)][0]

  def seen_enough():
    """M made 5 steps in the partition, the others' merges installed 4 fragments in it (0.1 s
    or more ago), and the heartbeats found M absent."""
    begin, now = partition_began(), time.monotonic()
    return (len([e for e in steps.events if e[1] == M and e[0] > begin]) >= 5
            and len({p for t, p, _ in installs.events if begin + 0.05 < t < now - 0.1}) >= 4
            and run.syncer.stats.absences >= 1)

  clock = _HeldNetworkClock(run.injector.network, seen_enough)
  summary = train.execute(run, progress=False)

  # Its step hook runs just before the injector's: the partition's start, to the microsecond.
  begin, end = partition_began(), clock.healed_at
  [fault] = summary["faults"]
  assert (fault["fault"], fault["learner"], fault["step"]) == ("partition", M, S)
  assert fault["ended_at_s"] == round(fault["at_s"] + SECONDS, 3)
  assert fault["messages_lost"] > 0 and summary["partition_messages_lost"] == fault["messages_lost"]
  # It trained on; the others kept merging without it.
  assert end is not None and end >= begin + SECONDS
  assert len([e for e in steps.events if e[1] == M and begin < e[0] < end]) >= 5
  # Installed well inside the partition (its broadcast was lost): not in the milliseconds between
  # this hook and the injector's cut, when a broadcast could still get through.
  missed = {}
  for t, p, version in installs.events:
    if begin + 0.05 < t < end - 0.05:
      missed[p] = max(missed.get(p, 0), version)
  assert len(missed) >= 4, "the others kept merging during the partition"
  assert not [e for e in received.events if begin + 0.01 < e[0] < end - 0.01], "nothing crossed"
  # Heartbeats saw it absent, then back; taken back, it was sent every Theta_p it missed at once,
  # not each at its fragment's own next merge.
  assert summary["heartbeat_absences"] >= 1 and summary["heartbeat_returns"] >= 1
  backs = [r for r in metrics_lib.read_records(str(tmp_path), "back") if r["learner"] == M]
  # (A fragment merged again after the heal reached it by that merge's own broadcast first, and
  # its report then said it held it: the take-back owes it only the others.)
  remerged = {p for t, p, _ in installs.events if t >= end - 0.05}
  assert any(set(b["fragments_sent"]) >= set(missed) - remerged for b in backs), (backs, missed)
  caught_up = {}
  for t, p, version in received.events:
    if t >= end:
      caught_up[p] = max(caught_up.get(p, 0), version)
  assert all(caught_up.get(p, 0) >= v for p, v in missed.items()), (missed, caught_up)
  assert summary["learner_steps"] == [48] * 4 and summary["rejoins"] == 0
  tokens = summary["fragment_token_accounting"]
  assert tokens["made"] == (tokens["merged"] + tokens["discarded"] + tokens["lost_at_failures"]
                            + tokens["unmerged_at_end"])
  assert tokens["made"] == summary["tokens_trained"] * summary["num_fragments"]
  assert summary["double_merged_offers"] == 0 and summary["unmerged_steps_at_end"] == [0] * 4


def test_a_partition_loses_posts_pulls_and_broadcasts_and_heals_on_time():
  now = [0.0]
  network = network_lib.Network(clock=lambda: now[0])

  class Link:
    delivered = []

    def offer(self, p, merged_through):
      return messages.Answer.NOTHING

    def deliver(self, broadcast):
      self.delivered.append(broadcast)

  link = network.link(1, Link())
  record = {}
  network.partition(1, 2.0, record)
  assert network.lost(1) and not network.lost(0)  # a post of learner 1 is lost, learner 0's not
  assert link.offer(0, 0) is messages.Answer.UNREACHABLE
  link.deliver(messages.Broadcast(0, 1, {}))
  assert not Link.delivered
  assert record == {"messages_lost": 2, "pulls_lost": 1}
  now[0] = 2.0  # healed
  assert not network.lost(1) and link.offer(0, 0) is messages.Answer.NOTHING
  link.deliver(messages.Broadcast(0, 1, {}))
  assert len(Link.delivered) == 1 and record["messages_lost"] == 2
