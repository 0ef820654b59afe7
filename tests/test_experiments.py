"""Every experiment config validates, and the reference TPU configs build their meshes.

The TPU configs need hundreds of devices: a subprocess fakes that many CPU devices and builds the
learner and syncer meshes from the config, as the runtime does on a pod.
"""

import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import TEST_XLA_FLAGS
from decoupled_diloco import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(p for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))
                     if not os.path.basename(p).startswith("_"))


def _load_module(path):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


@pytest.mark.parametrize("path", EXPERIMENTS, ids=os.path.basename)
def test_experiment_config_is_valid(path):
  config = _load_module(path)
  run = settings.validate(config)
  assert run.num_learners >= 1


_BUILD_MESHES = r"""
import json, sys
sys.path.insert(0, {root!r})
from decoupled_diloco import settings
from decoupled_diloco.runtime.core import devices
import importlib.util
spec = importlib.util.spec_from_file_location("cfg", {path!r})
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
config = module.get_config()
run = settings.validate(config)
learner_meshes, syncer_mesh = devices.build_meshes(run.learner_mesh_shapes, run.syncer.num_devices,
                                                   "cpu")
seen = [d.id for m in learner_meshes for d in m.devices.flat]
print(json.dumps({{"shapes": [list(m.devices.shape) for m in learner_meshes],
                  "axes": list(learner_meshes[0].axis_names), "distinct": len(set(seen)) == len(seen),
                  "syncer": int(syncer_mesh.devices.size)}}))
"""


@pytest.mark.parametrize("name,num_devices,shapes", [
    ("gemma_2b_v5p.py", 8 * 64 + 1, [[2, 8, 4]] * 8),
    ("hetero_v6e_v5p.py", 4 * 64 + 4 * 32 + 1, [[2, 8, 4]] * 4 + [[1, 8, 4]] * 4),
    ("dense_5b_v5p.py", 8 * 64 + 1, [[2, 8, 4]] * 8),
])
def test_tpu_reference_config_builds_its_learner_meshes(name, num_devices, shapes):
  path = os.path.join(ROOT, "experiments", name)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={num_devices}")
  out = subprocess.run([sys.executable, "-c", _BUILD_MESHES.format(root=ROOT, path=path)],
                       env=env, capture_output=True, text=True, timeout=240, check=True)
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["shapes"] == shapes
  assert result["axes"] == ["data", "fsdp", "model"]
  assert result["distinct"], "learner meshes must not share devices"
  assert result["syncer"] == 1


def test_too_few_devices_is_a_clear_error():
  from decoupled_diloco.runtime.core import devices  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="need 40 cpu devices"):
    devices.build_meshes(((4, 2),) * 5, 0, "cpu")
