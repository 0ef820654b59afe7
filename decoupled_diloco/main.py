r"""Entry point: python -m decoupled_diloco.main --config=experiments/tiny_cpu.py [--config.a.b=v].

Only parses flags; the run lives in `train.train_and_evaluate`.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco.runtime import devices
from decoupled_diloco.runtime import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  # Fake CPU devices must be requested before anything asks JAX for its devices.
  devices.request_fake_cpu_devices(config.devices.num_fake_cpu_devices)
  train.train_and_evaluate(config)


if __name__ == "__main__":
  app.run(main)
