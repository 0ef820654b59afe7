"""The runtime's goodput: gathers the timestamps a run recorded and hands them to the pure
accounting (`algorithm/time_buckets.py`), which splits each learner's wall time into buckets.

Timestamps, all `time.monotonic()`:
  - each learner incarnation: when its first step started, when each step completed (with the
    step's duration, its start), and when it failed (`Learner.train_started_at`, `step_ends`,
    `step_times`, `failed_at`); the step in flight at a failure counts as compute of a lost step;
  - the supervisor's records: when the failed learner's devices were repaired (its rejoin began);
    down is failure -> repair, restart is repair -> the next incarnation's first step;
  - the injector's hang records: a hung learner is idle, not training, for that long.

Which step seconds were useful comes from the fragment-token accounting (the tokens each learner
made, the ones its overwrites discarded, the ones lost with a failed incarnation, the ones unmerged
at the end), apportioned per learner (see `time_buckets`).

A checkpoint stores the accounting so far in the run's history (`time_accounting`); a resumed run
adds its own segment, so its summary covers the whole run. The seconds between a checkpoint and
the stop are in neither segment, as they are in no `wall_seconds`: the steps made then are made
again after the resume. At a checkpoint the tokens still unmerged count as useful (the resumed run
carries them on), and a failed learner's lost tokens are what its counters held (merges in flight
that still took some in are not subtracted until the run's end).
"""

from __future__ import annotations

from typing import Any

from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.algorithm import time_buckets as tb


def _step_intervals(learner) -> list[tb.Interval]:
  ends, times = list(learner.step_ends), list(learner.step_times)
  steps = [(end - duration, end) for end, duration in zip(ends, times)]
  if learner.failed_at is not None and learner.train_started_at is not None:
    # The step in flight when it failed: dispatched (and counted as made), never completed.
    steps.append((ends[-1] if ends else learner.train_started_at, learner.failed_at))
  return steps


def segment(run, *, started_at: float, ended_at: float, final: bool) -> tb.Accounting:
  """This process's share of the run (since `started_at`) as of `ended_at`.

  `final`: the run is over, so the tokens its learners still hold unmerged will never reach the
  global model (after the final flush, normally none).
  """
  settings = run.settings
  num_fragments = max(len(run.fragments), 1)
  supervisor = run.supervisor
  retired = list(supervisor.retired) if supervisor is not None else []
  current = list(run.learners)
  records = supervisor.summary_records() if supervisor is not None else []
  tape = run.syncer.tape if run.syncer is not None else []
  injector = run.injector
  hangs = [r for r in (list(injector.records) if injector is not None else [])
           if r["fault"] == "hang"]
  timelines = {}
  for m in range(len(current)):
    incarnations = [l for l in retired if l.index == m] + [current[m]]
    by_number = {l.incarnation: l for l in incarnations}
    steps = [i for l in incarnations for i in _step_intervals(l)]
    down, restarting, lost = [], [], 0
    for record in (r for r in records if r["learner"] == m):
      failed = by_number.get(record["incarnation"])
      failed_at = failed.failed_at if failed is not None and failed.failed_at else (
          started_at + record["failed_at_s"])
      if "repaired_at_s" not in record:  # never restarted (config.max_restarts), or still down
        down.append((failed_at, ended_at))
      else:
        repaired = started_at + record["repaired_at_s"]
        down.append((failed_at, repaired))
        after = by_number.get(record["incarnation_after"])
        first = after.train_started_at if after is not None else None
        restarting.append((repaired, first if first is not None else ended_at))
      held = sum(record.get("counter_tokens", ()))
      lost += held - (tape_lib.merged_after_failure(tape, m, record["incarnation"],
                                                    record["anchor_versions"])
                      if final and tape else 0)
    waits = [(injector.clock_at(r["at_s"]), injector.clock_at(r["at_s"]) + r["seconds"])
             for r in hangs if r["learner"] == m]
    # Lock-step modes: time at a barrier (the sync, slower peers, a peer under repair) is idle.
    waits += [w for l in incarnations for w in l.barrier_waits]
    discarded = sum(l.discarded_fragment_tokens for l in incarnations)
    if final and current[m] not in retired:
      discarded += int(current[m].counters().tokens.sum())
    timelines[m] = tb.LearnerTimeline(
        steps=steps, down=down, restarting=restarting, waits=waits,
        made_tokens=(sum(l.steps_made for l in incarnations) * settings.tokens_per_step(m)
                     * num_fragments),
        discarded_tokens=int(discarded), lost_tokens=int(lost))
  return tb.account(timelines, started_at, ended_at)


def whole_run(run, *, started_at: float, ended_at: float, final: bool) -> tb.Accounting:
  """The earlier segments' accounting (a resumed run's history) plus this one's."""
  earlier = tb.Accounting.from_json(run.history.get("time_accounting"))
  return earlier.add(segment(run, started_at=started_at, ended_at=ended_at, final=final))


def summary(accounting: tb.Accounting) -> dict[str, Any]:
  """The summary.json keys: goodput, uptime and each learner's buckets in seconds."""
  return {
      "goodput": round(accounting.goodput, 4),
      "uptime": round(accounting.uptime, 4),
      "time_buckets": {str(m): {k: round(v, 3) for k, v in b.items()}
                       for m, b in accounting.buckets.items()},
  }
