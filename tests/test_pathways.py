"""Pathways through pathwaysutils (runtime/core/pathways.py): its initialisation before JAX starts a
backend, the platform its devices have, and its reading of errors and slices.

There is no Pathways backend here. The command runs in a process of its own with
JAX_PLATFORMS=proxy and pathwaysutils.initialize replaced by a recorder that registers a CPU client
as the proxy backend (what the real one registers is a client of the Pathways proxy server); the
classification and the slice check are pathwaysutils' own, on errors built as a lost slice raises
them and on devices that carry a slice index as TPU devices do.
"""

import os
import pathlib
import subprocess
import sys
import types

import jax
import pytest
from pathwaysutils.elastic import elastic

from conftest import tiny_flags
from decoupled_diloco import errors
from decoupled_diloco.runtime.core import devices
from decoupled_diloco.runtime.core import learner
from decoupled_diloco.runtime.core import pathways
from decoupled_diloco.runtime.faults import injector

_ROOT = pathlib.Path(__file__).resolve().parents[1]

# The command, with pathwaysutils.initialize recorded: whether JAX had started a backend when it
# was called. Run with JAX_PLATFORMS=proxy.
_RECORDED_COMMAND = """
import sys
import pathwaysutils
from jax._src import xla_bridge
from jax.extend import backend

calls = []

def recording_initialize():
  calls.append(xla_bridge.backends_are_initialized())
  backend.register_backend_factory("proxy", xla_bridge.make_cpu_client, priority=-1)

pathwaysutils.initialize = recording_initialize
from decoupled_diloco import main
sys.argv = ["main", *sys.argv[1:]]
try:
  main.run()
finally:
  print(f"initialize calls, with a backend started: {calls}")
"""


def _command(code: str, tmp_path, **overrides) -> subprocess.CompletedProcess:
  flags = tiny_flags(devices__platform="tpu", devices__num_fake_cpu_devices=0,
                     workdir=tmp_path / "run", **overrides)
  env = dict(os.environ, JAX_PLATFORMS="proxy",
             PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
  return subprocess.run([sys.executable, "-c", code, "--config=experiments/tiny_cpu.py", *flags],
                        cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300,
                        check=False)


def test_under_jax_platforms_proxy_the_command_initializes_pathwaysutils_before_any_backend(
    tmp_path):
  out = _command(_RECORDED_COMMAND, tmp_path)
  assert "initialize calls, with a backend started: [False]" in out.stdout, out.stdout + out.stderr
  # Then the learners' devices were looked up through the proxy backend: this one's are CPUs, not
  # the TPU chips of Pathways, and the run refuses them in one line.
  lines = out.stderr.strip().splitlines()
  assert out.returncode == errors.EXIT_BAD_INPUT and "Traceback" not in out.stderr, out.stderr
  assert lines[-1] == ("Invalid config: config.devices.platform='tpu': the proxy backend of "
                       "JAX_PLATFORMS='proxy' has no such devices (its devices are ['cpu'])")
  assert not (tmp_path / "run").exists()


def test_a_missing_pathwaysutils_is_refused_in_one_line_naming_what_to_install(tmp_path):
  code = ("import sys\n"
          "sys.modules['pathwaysutils'] = None  # as if not installed: its import fails\n"
          "from decoupled_diloco import main\n"
          "sys.argv = ['main', *sys.argv[1:]]\n"
          "main.run()\n")
  out = _command(code, tmp_path)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == errors.EXIT_BAD_INPUT and len(lines) == 1, out.stderr
  assert lines[0] == ("Cannot start under Pathways: JAX_PLATFORMS='proxy' names Pathways' proxy "
                      "backend, which needs pathwaysutils: pip install "
                      "'decoupled-diloco[pathways]' (or pip install pathwaysutils)")


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_under_pathways_the_learners_platform_is_tpu(monkeypatch, platform):
  monkeypatch.setattr(pathways, "in_use", lambda: True)
  monkeypatch.setattr(pathways, "jax_platforms", lambda: "proxy")
  monkeypatch.setattr(pathways, "initialize", lambda: pytest.fail("initialized before refusing"))
  with pytest.raises(errors.InputError, match=(
      rf"config.devices.platform='{platform}' but JAX_PLATFORMS='proxy' names Pathways' proxy "
      r"backend, whose devices are TPU chips: set config.devices.platform='tpu'")):
    devices.use_platform(platform)


@pytest.mark.parametrize("error, lost", [
    (jax.errors.JaxRuntimeError("DATA_LOSS: the slice of this program's devices went down"), True),
    # pathwaysutils takes these as lost slices too (it logs that they may not be).
    (jax.errors.JaxRuntimeError("INTERNAL: Core halted unexpectedly"), True),
    (jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: the slice did not answer"), True),
    (jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of HBM allocating 2.0G"), False),
    (jax.errors.JaxRuntimeError("INVALID_ARGUMENT: shapes do not match"), False),
    (RuntimeError("DATA_LOSS: not raised by JAX"), False),
    (injector.LearnerFailure("learner 1: its devices failed before step 4"), False),
    (learner.NonFiniteLoss("learner 1 (incarnation 0): the loss of step 4 is nan"), False),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_a_lost_slice_is_what_pathwaysutils_reads_as_one(error, lost):
  assert pathways.is_lost_slice(error) is lost


class _Checker(elastic.SliceHealthChecker):
  """pathwaysutils' health check, answered by the test: these slices are up."""

  active: frozenset[int] = frozenset()
  checked: list[frozenset[int]] = []

  def dispatch(self):
    _Checker.checked.append(frozenset(self.slice_to_devices))

  def validate(self):
    return _Checker.active & frozenset(self.slice_to_devices)


def test_a_learners_slices_are_back_once_pathwaysutils_finds_every_one_of_them_active(monkeypatch):
  monkeypatch.setattr(elastic, "DefaultSliceHealthChecker", _Checker)
  # A learner over two slices (2 and 3), as TPU devices carry their slice's index.
  learner_devices = [types.SimpleNamespace(id=i, slice_index=2 + i // 4) for i in range(8)]
  _Checker.checked = []
  _Checker.active = frozenset({0, 1, 2})
  assert not pathways.slices_active(learner_devices)
  _Checker.active = frozenset({2, 3})
  assert pathways.slices_active(learner_devices)
  # Only its own slices were checked, never another learner's.
  assert _Checker.checked == [frozenset({2, 3})] * 2
