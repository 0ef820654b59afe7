"""The device-memory check of learners that share devices (runtime/hardware/device_memory.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import tiny_settings
from decoupled_diloco.runtime.hardware import device_memory
from decoupled_diloco.runtime.core import device_share
from decoupled_diloco.runtime import train


def test_a_device_holds_its_shard_of_each_array():
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "model"))
  split = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  whole = jax.ShapeDtypeStruct((8, 6), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  assert device_memory.per_device_bytes({"a": split, "b": whole}) == 4 * 6 * 4 + 8 * 6 * 2


def test_what_a_device_holds_counts_every_learner_on_it_and_two_steps():
  """Four learners of 10 state bytes (4 of them parameters): donating, each keeps a copy of its
  parameters for its publication; not donating, a whole second state. Offers in flight: a copy
  of the parameters each. Two steps' temporaries and batches at most (one for a learner alone,
  whose steps follow each other on the device); the eval model once."""
  parts = device_memory.needs(state_bytes=10, params_bytes=4, step_temp_bytes=7, batch_bytes=1,
                              donates=True, learners=4, eval_params_bytes=3)
  assert parts == {"train states": 40, "publications": 16, "offers in flight": 16,
                   "step working memory": device_share.SLOTS * 8, "eval model": 3}
  parts = device_memory.needs(state_bytes=10, params_bytes=4, step_temp_bytes=7, batch_bytes=1,
                              donates=False, learners=1, eval_params_bytes=0)
  assert parts["publications"] == 10 and parts["train states"] == 10
  assert parts["step working memory"] == 8


def test_a_run_that_does_not_fit_fails_before_placing_anything_naming_the_fields(tmp_path):
  """Four tiny learners on one device need ~5 MB (their states, publications, offers, two
  steps' temporaries and the eval model); a device of 1 MB cannot hold them, one of 100 MB can."""
  with pytest.raises(device_memory.DeviceMemoryError) as raised:
    train.build(tiny_settings(tmp_path / "small", learner_mesh_shapes=((1, 1),),
                              devices__learners_sharing_devices=4,
                              devices__memory_per_device_gb=0.001))
  message = str(raised.value)
  for field in ("config.devices.learners_sharing_devices=4", "config.data.batch_size",
                "config.learner_mesh_shapes", "config.devices.memory_per_device_gb=0.001",
                "train states", "eval model"):
    assert field in message, message
  needed = float(message.split(" need ")[1].split(" MB")[0])
  assert 1.0 < needed < 100.0
  run = train.build(tiny_settings(tmp_path / "large", learner_mesh_shapes=((1, 1),),
                                  devices__learners_sharing_devices=4,
                                  devices__memory_per_device_gb=0.1))
  assert len(run.learners) == 4
  run.metrics.close()


def test_a_cpu_device_reports_no_memory_so_the_limit_is_the_config_field():
  cpu = jax.devices("cpu")[0]
  assert device_memory.limit_bytes(cpu, 0.0) == (None, "")
  assert device_memory.limit_bytes(cpu, 2.5)[0] == int(2.5e9)
