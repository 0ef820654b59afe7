"""Quiet by default: the run's own lines and every real warning pass; the libraries' INFO does not."""

import logging
import os

from absl import logging as absl_logging

import decoupled_diloco
from decoupled_diloco.runtime import quiet_logs

_OWN = os.path.join(os.path.dirname(decoupled_diloco.__file__), "runtime", "train.py")
_SITE = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")


def _record(pathname, level, msg, *args):
  return logging.LogRecord("absl", level, pathname, 1, msg, args, None)


def test_the_runs_own_info_lines_pass_and_the_libraries_do_not():
  keep = quiet_logs.LibraryInfoFilter().filter
  assert keep(_record(_OWN, logging.INFO, "step %d/%d | loss 2.5", 25, 400))
  orbax = os.path.join(_SITE, "orbax", "checkpoint", "_src", "path", "atomicity.py")
  assert not keep(_record(orbax, logging.INFO, "Creating tmp directory %s", "/tmp/x"))
  jax_cache = os.path.join(_SITE, "jax", "_src", "compilation_cache.py")
  assert not keep(_record(jax_cache, logging.DEBUG, "Resetting cache at <empty>."))


def test_the_running_script_is_one_of_the_runs_own():
  script = os.path.join(os.sep, "repo", "scripts", "sample.py")
  assert quiet_logs.LibraryInfoFilter((script,)).filter(_record(script, logging.INFO, "sampled"))


def test_warnings_pass_from_anyone_but_the_known_harmless_ones():
  keep = quiet_logs.LibraryInfoFilter().filter
  orbax = os.path.join(_SITE, "orbax", "checkpoint", "checkpoint_manager.py")
  assert keep(_record(orbax, logging.WARNING, "could not write %s", "/ckpt/7"))
  assert keep(_record(_OWN, logging.ERROR, "learner %d failed", 2))
  grain = os.path.join(_SITE, "grain", "_src", "core", "sharding.py")
  assert not keep(_record(grain, logging.WARNING, "Dropping %d examples of %d examples (shard %d).",
                          2, 8214, 4))
  assert keep(_record(grain, logging.WARNING, "Something else went wrong"))


def test_verbosity_asks_for_everything(monkeypatch):
  handler = absl_logging.get_absl_handler()
  before = list(handler.filters)
  assert quiet_logs.install(verbosity=1) is None
  assert handler.filters == before
  monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "0")  # the user's own setting is kept
  installed = quiet_logs.install(verbosity=0)
  try:
    assert installed in handler.filters
    assert os.environ["TF_CPP_MIN_LOG_LEVEL"] == "0"
  finally:
    handler.removeFilter(installed)
