r"""Entry point: python -m decoupled_diloco.main --config=experiments/tiny_cpu.py [--config.a.b=v].

Only parses flags and validates the config; the run lives in `runtime.train.train_and_evaluate`. A
bad field, on the command line or in the file, ends in one line that names it, before anything
compiles: it is the user's to fix, and a traceback would only hide the name.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco import settings
from decoupled_diloco.runtime import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    run_settings = settings.validate(_CONFIG.value)
  except ValueError as err:
    sys.exit(f"Invalid config: {err}")
  train.train_and_evaluate(run_settings)


if __name__ == "__main__":
  app.run(main)
