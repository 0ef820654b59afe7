"""Quiet by default: the run's own lines and every real warning pass; the libraries' INFO does not."""

import logging
import os
import pathlib
import re
import subprocess
import sys

import pytest

from absl import logging as absl_logging

import decoupled_diloco
from decoupled_diloco.runtime.control import quiet_logs

_OWN = os.path.join(os.path.dirname(decoupled_diloco.__file__), "runtime", "control",
                    "controller.py")
_SITE = os.path.join(os.sep, "venv", "lib", "python3.11", "site-packages")
_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _record(pathname, level, msg, *args):
  return logging.LogRecord("absl", level, pathname, 1, msg, args, None)


def test_the_runs_own_info_lines_pass_and_the_libraries_do_not():
  keep = quiet_logs.LibraryInfoFilter().filter
  assert keep(_record(_OWN, logging.INFO, "step %d/%d | loss 2.5", 25, 400))
  # Every folder of the package is the run's own, its top level too: settings.py says at
  # start-up when it cut a short run's warmup.
  for module in ("settings.py", os.path.join("lm", "data.py"),
                 os.path.join("runtime", "core", "learner.py")):
    path = os.path.join(os.path.dirname(decoupled_diloco.__file__), module)
    assert keep(_record(path, logging.INFO, "config.inner.warmup_steps=40 is more than 50%")), path
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


def _run_main(workdir, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
  env.pop("XLA_FLAGS", None)  # as in a user's shell: the run asks for its fake devices
  return subprocess.run(
      [sys.executable, "-m", "decoupled_diloco.main", "--config=experiments/tiny_cpu.py",
       f"--config.workdir={workdir}", "--config.mode=dp", "--config.num_steps=2",
       "--config.checkpoint.every_steps=1", "--config.eval_batches=1", "--config.log_every=1",
       "--config.compilation_cache_dir=none", *args],
      cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.slow  # 8 s, a whole run; the log filter's own tests above stay in the default suite
def test_a_run_with_checkpoints_logs_only_its_own_lines(tmp_path):
  """The whole command: orbax writes three checkpoints (~50 INFO lines each before), and none of
  its lines reach the terminal; the run's progress, checkpoint and final lines do."""
  out = _run_main(tmp_path / "run")
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  sources = {m.group(1) for m in map(re.compile(r"^[IWEF]\d{4} [\d:.]+ +\d+ ([\w.]+):\d+\]").match,
                                      lines) if m}
  assert sources <= {"main.py", "settings.py", "train.py", "controller.py",
                     "checkpoint_cadence.py", "device_memory.py"}, out.stderr
  text = out.stderr
  assert "step 1/2 |" in text and "checkpoint of step" in text and "done: final eval loss" in text
  assert len(lines) < 20, out.stderr
