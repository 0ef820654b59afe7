"""The live bar: drawn in place on a terminal only, cleared before every log line."""

import io
import logging as std_logging

from absl import logging

from decoupled_diloco.runtime.control import live_bar
from conftest import HandClock


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_a_pipe_gets_no_bar():
  pipe = io.StringIO()
  bar = live_bar.LiveBar(400, stream=pipe)
  bar.show(37)
  bar.close()
  assert pipe.getvalue() == ""


def test_a_terminal_sees_the_step_redrawn_at_most_every_interval():
  terminal, clock = _Terminal(), HandClock(now=0.0)
  bar = live_bar.LiveBar(400, stream=terminal, clock=clock, interval_s=0.5)
  try:
    bar.show(100)
    bar.show(101)  # too soon: not drawn
    clock.now += 0.6
    bar.show(102)
  finally:
    bar.close()
  drawn = [part for part in terminal.getvalue().split("\r") if "step" in part]
  assert [d.split("step ")[1] for d in drawn] == ["100/400", "102/400"]
  assert drawn[0].startswith("[" + "#" * 7 + ".")  # a quarter of 30 characters
  assert terminal.getvalue().endswith("\r\033[K")  # closed: the line is clear again


def test_a_log_line_clears_the_bar_first():
  terminal = _Terminal()
  handler = logging.get_absl_handler()
  bar = live_bar.LiveBar(400, stream=terminal)
  try:
    bar.show(10)
    written = terminal.getvalue()
    clear_first = [f for f in handler.filters if isinstance(f, live_bar._ClearFirst)]
    assert len(clear_first) == 1  # (the session may hold other filters: quiet_logs' of a run)
    assert clear_first[0].filter(std_logging.makeLogRecord({"msg": "x"}))
    assert terminal.getvalue() == written + "\r\033[K"
  finally:
    bar.close()
  assert not any(isinstance(f, live_bar._ClearFirst) for f in handler.filters)
