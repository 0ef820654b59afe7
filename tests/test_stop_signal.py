"""A stop signal and its copies: runtime/control/signals.py's handler called directly, on a fake clock."""

import signal

from decoupled_diloco.runtime.control import signals
from conftest import HandClock


def _handler():
  clock, exits = HandClock(now=100.0), []
  return signals.StopSignal(clock=clock, exit_now=exits.append), clock, exits


def test_a_second_sigint_within_the_window_is_the_same_signal():
  """`timeout` and schedulers signal the process group: two SIGINTs ms apart are one request."""
  stop, clock, exits = _handler()
  stop._handle(signal.SIGINT, None)
  clock.now += 0.002
  stop._handle(signal.SIGINT, None)
  clock.now += signals.SAME_SIGNAL_WINDOW_S * 0.9
  stop._handle(signal.SIGTERM, None)
  assert stop.signum == signal.SIGINT  # still the first one: a checkpoint, then a clean stop
  assert exits == []


def test_a_signal_after_the_window_exits_at_once():
  stop, clock, exits = _handler()
  stop._handle(signal.SIGTERM, None)
  clock.now += signals.SAME_SIGNAL_WINDOW_S + 0.01
  stop._handle(signal.SIGINT, None)
  assert exits == [128 + signal.SIGINT]


def test_the_window_counts_from_the_first_signal_not_the_last_copy():
  """Copies keep arriving (a wrapper that re-sends): they do not push the window on."""
  stop, clock, exits = _handler()
  stop._handle(signal.SIGINT, None)
  for _ in range(3):
    clock.now += signals.SAME_SIGNAL_WINDOW_S * 0.4
    stop._handle(signal.SIGINT, None)
  assert exits == [128 + signal.SIGINT]
