"""Who is absent: heartbeat detection of learners that stopped reporting (docs/design.md §6).

Every inner step a learner reports to the syncer (`StepReport`); those reports are its heartbeat.
A learner whose last report is older than its timeout is *absent*: the syncer no longer counts it
for a quorum, does not wait for it in a grace window, and merges nothing it offers late. It may be
hung, partitioned away, or dead without a word: the decision only looks at report times, never at
why they stopped (the recovery code must not know whether a fault was injected). A report from an
absent learner takes it back at once.

The timeout is `config.sync.heartbeat_timeout_s` seconds, or, when that is 0 (auto),
AUTO_MULTIPLE x the learner's step-time EMA, never less than AUTO_FLOOR_S:

- the EMA follows each learner's own pace, so a slower (heterogeneous) learner is not taken for a
  hung one, and one timeout suits a 30 ms CPU step and a 10 s step of a large model alike;
- AUTO_MULTIPLE = 10: ten missed steps is far beyond the jitter of a healthy learner (with the
  EMA's decay of 0.9 a single step 10x the mean moves the EMA by only 90%); the grace window spends
  at most tau = 2 step times, so a learner silent for 10 is no longer one the window could admit;
- AUTO_FLOOR_S = 5: host hiccups that do not scale with the step (a garbage collection, an eval
  that borrows a learner's devices, a checkpoint's copy to host, a busy 2-core CI box) must not
  read as failures, and the first report after a (re)start comes before any EMA exists.

Learners that share devices (config.devices.learners_sharing_devices = n, runtime/core/device_share.py)
take turns on them, so each one's step time, measured from one of its completed steps to the next,
is a turn of all n: n x the device's step. That is its pace, and ten of those is still ten of its
own steps, so the EMA rule needs nothing more. What changes is what comes before any EMA: at the
start (and after a rejoin, or anything that held the devices) all n queue for their turns at once,
and the last one's first report comes after the steps of all n; so the floor is n x AUTO_FLOOR_S
(`sharing`). Were a learner's step time instead its own program's time on the device, 10 x that
would call a learner absent that merely waits for its turn whenever n > 10.

Pure: report times, EMAs and "now" in, a set of learners out.
"""

from __future__ import annotations

from collections.abc import Mapping

AUTO_MULTIPLE = 10.0
AUTO_FLOOR_S = 5.0


def timeout_s(configured_s: float, step_time_ema_s: float | None, sharing: int = 1) -> float:
  """Seconds of silence after which a learner is absent.

  `configured_s` > 0 is taken as is; 0 means auto: AUTO_MULTIPLE x `step_time_ema_s` (None before
  the learner's first report), never below `sharing` (the learners on its devices) x AUTO_FLOOR_S.
  """
  if configured_s > 0:
    return configured_s
  return max(AUTO_MULTIPLE * (step_time_ema_s or 0.0), sharing * AUTO_FLOOR_S)


def absent(last_report_at: Mapping[int, float], step_time_emas: Mapping[int, float | None],
           now: float, configured_s: float, sharing: int = 1) -> frozenset[int]:
  """The learners of `last_report_at` (learner -> time of its last report, or of its start before
  its first) that have been silent for longer than their timeout at `now`; `sharing` learners on
  each one's devices."""
  return frozenset(
      m for m, reported_at in last_report_at.items()
      if now - reported_at > timeout_s(configured_s, step_time_emas.get(m), sharing))
