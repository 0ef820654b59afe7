"""Tests for algorithm.schedule: the staggered sync schedule (docs/design.md §3)."""

import math

import pytest

from decoupled_diloco.algorithm.schedule import SyncSchedule

CONFIGS = [  # (P, H, τ)
    (1, 1, 0),
    (1, 10, 3),
    (4, 24, 2),
    (3, 9, 8),
    (24, 24, 2),
    (8, 32, 5),
]


def _due_steps(schedule, p, last_step):
  return [t for t in range(1, last_step + 1) if schedule.is_due(p, t)]


@pytest.mark.parametrize("P, H, tau", CONFIGS)
def test_each_fragment_is_due_exactly_every_period(P, H, tau):
  schedule = SyncSchedule(P, H, tau)
  for p in range(P):
    steps = _due_steps(schedule, p, 6 * H)
    assert len(steps) == 6
    assert all(b - a == H for a, b in zip(steps, steps[1:]))
    # The first sync comes after offset(p) steps, or after a full period for offset 0.
    assert steps[0] == (schedule.offset(p) or H)


@pytest.mark.parametrize("P, H, tau", CONFIGS)
def test_due_fragments_agrees_with_is_due(P, H, tau):
  schedule = SyncSchedule(P, H, tau)
  for t in range(0, 4 * H + 1):
    assert schedule.due_fragments(t) == tuple(p for p in range(P) if schedule.is_due(p, t))


def test_with_p_equal_h_one_fragment_starts_every_step():
  schedule = SyncSchedule(num_fragments=24, period=24, overlap=2)
  for t in range(1, 3 * 24 + 1):
    assert schedule.due_fragments(t) == (t % 24,)
  assert schedule.due_fragments(0) == ()  # nothing before the first step


def test_offsets_are_evenly_spaced():
  # H / P = 24 / 4 = 6 steps apart.
  schedule = SyncSchedule(4, 24, 0)
  assert [schedule.offset(p) for p in range(4)] == [0, 6, 12, 18]
  assert schedule.stride == 6


def test_a_single_fragment_is_plain_diloco():
  # P = 1: the whole model every H steps, after steps H, 2H, ...
  schedule = SyncSchedule(1, 10, 0)
  assert _due_steps(schedule, 0, 35) == [10, 20, 30]


@pytest.mark.parametrize("P, H, tau", CONFIGS)
def test_at_most_ceil_tau_plus_one_times_p_over_h_fragments_in_flight(P, H, tau):
  schedule = SyncSchedule(P, H, tau)
  bound = math.ceil((tau + 1) * P / H)
  counts = []
  for t in range(1, 5 * H + 1):
    # Independently of in_flight(): every sync (p, s) started after step s <= t and applied
    # after step s + τ >= t.
    started = [(p, s) for p in range(P) for s in range(1, t + 1) if schedule.is_due(p, s)]
    expected = sorted(p for p, s in started if t <= schedule.apply_step(s))
    assert sorted(schedule.in_flight(t)) == expected
    counts.append(len(expected))
  assert max(counts) <= bound
  assert max(counts) == bound  # and the bound is reached: it is tight


def test_two_fragments_overlap_each_compute_step_at_the_paper_defaults():
  # P = H = 24, τ = 2 (docs/design.md §3: "about two fragments are in flight"): while inner step t
  # computes, the syncs started after steps t-2 and t-1 are still travelling.
  schedule = SyncSchedule(24, 24, 2)
  for t in range(3, 100):
    travelling = [
        p for s in range(1, t) for p in schedule.due_fragments(s) if schedule.apply_step(s) >= t
    ]
    assert travelling == [(t - 2) % 24, (t - 1) % 24]


def test_apply_step_adds_the_overlap():
  assert SyncSchedule(24, 24, 2).apply_step(30) == 32
  assert SyncSchedule(24, 24, 0).apply_step(30) == 30


@pytest.mark.parametrize("P, H, tau", CONFIGS)
def test_round_index_counts_the_syncs_started_so_far(P, H, tau):
  schedule = SyncSchedule(P, H, tau)
  for p in range(P):
    for t in range(0, 4 * H + 1):
      assert schedule.round_index(p, t) == len(_due_steps(schedule, p, t))


def test_round_index_by_hand():
  # P = 4, H = 24: fragment 1 is due after steps 6, 30, 54; fragment 0 after 24, 48.
  schedule = SyncSchedule(4, 24, 0)
  assert [schedule.round_index(1, t) for t in (5, 6, 29, 30, 54)] == [0, 1, 1, 2, 3]
  assert [schedule.round_index(0, t) for t in (0, 23, 24, 47, 48)] == [0, 0, 1, 1, 2]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 24, 0), r"config\.sync\.num_fragments=0 must be an integer >= 1"),
        ((2, 0, 0), r"config\.sync\.period=0 must be an integer >= 1"),
        ((5, 24, 0), r"period=24 must be a multiple of config\.sync\.num_fragments=5"),
        ((48, 24, 0), r"period=24 must be a multiple of config\.sync\.num_fragments=48"),
        ((4, 24, -1), r"overlap=-1 must be an integer in \[0, config\.sync\.period=24\)"),
        ((4, 24, 24), r"config\.sync\.overlap=24 must be"),
        ((4.0, 24, 0), r"config\.sync\.num_fragments=4\.0"),
        ((4, 24, True), r"config\.sync\.overlap=True"),
    ],
)
def test_bad_settings_name_the_config_field(args, message):
  with pytest.raises(ValueError, match=message):
    SyncSchedule(*args)


def test_unknown_fragment_is_an_error():
  with pytest.raises(ValueError, match="fragment 4"):
    SyncSchedule(4, 24, 0).offset(4)
