"""Quiet logs by default: the run's own lines, the libraries' only when something is wrong.

A default run printed 1,789 lines for its 16 progress lines (2026-11-26): orbax logs ~50
INFO lines per checkpoint it writes (and the syncer writes one every 10 s), jax notes its cache,
grain warns once per learner about windows it drops by design. Every library here logs through
Python's `logging` (orbax through absl's), and absl's handler prints every record; a filter on that
handler keeps

  - INFO and DEBUG records of this package and of the script that runs (the progress lines, the
    build, checkpoints, evaluations, the final summary), and
  - every WARNING and above, of anyone, but those in HARMLESS_WARNINGS,

and drops the libraries' INFO. `--verbosity=1` (absl's flag; `-v 1`) shows everything as before;
`--verbosity=-1` hides the run's own INFO lines too (absl does that).
"""

from __future__ import annotations

import logging as std_logging
import os
import sys

from absl import logging

import decoupled_diloco

# The whole package, wherever this module sits in it (settings.py's lines are the run's own too).
_PACKAGE_DIR = os.path.dirname(os.path.abspath(decoupled_diloco.__file__))

# (a directory in the logging file's path, the start of the message): warnings that say nothing
# the user must act on.
HARMLESS_WARNINGS = (
    # grain's sampler drops the windows that do not divide evenly over the learners' shards: the
    # drop_remainder that data.make_train_loader asks for, a few windows of thousands.
    (f"{os.sep}grain{os.sep}", "Dropping "),
)


class LibraryInfoFilter(std_logging.Filter):
  """Passes a record unless it is a library's INFO / DEBUG or a harmless warning."""

  def __init__(self, own_files: tuple[str, ...] = ()):
    super().__init__()
    self._own_dir = _PACKAGE_DIR + os.sep
    self._own_files = frozenset(os.path.abspath(f) for f in own_files)

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING:
      return not any(directory in record.pathname and record.getMessage().startswith(start)
                     for directory, start in HARMLESS_WARNINGS)
    path = os.path.abspath(record.pathname)
    return path.startswith(self._own_dir) or path in self._own_files


def install(verbosity: int) -> LibraryInfoFilter | None:
  """Filters absl's handler unless `verbosity` (absl's --verbosity) > 0; returns the filter."""
  if verbosity > 0:
    return None
  # The C++ side (XLA, libtpu) logs to stderr itself: INFO off there too, unless the user set it.
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  main_file = getattr(sys.modules.get("__main__"), "__file__", None)
  log_filter = LibraryInfoFilter((main_file,) if main_file else ())
  handler = logging.get_absl_handler()
  for earlier in [f for f in handler.filters if isinstance(f, LibraryInfoFilter)]:
    handler.removeFilter(earlier)  # a second main() in one process (tests) keeps one filter
  handler.addFilter(log_filter)
  return log_filter
