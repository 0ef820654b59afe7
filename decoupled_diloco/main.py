r"""Entry point: python -m decoupled_diloco.main --config=experiments/tiny_cpu.py [--config.a.b=v].

Only parses flags and validates the config; the run lives in `runtime.train.train_and_evaluate`. A
bad field, on the command line or in the file, ends in one line that names it, before anything
compiles: it is the user's to fix, and a traceback would only hide the name.
"""

import re
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from decoupled_diloco import settings
from decoupled_diloco.runtime import checkpoints
from decoupled_diloco.runtime import device_memory
from decoupled_diloco.runtime import event_tape
from decoupled_diloco.runtime import replay_config
from decoupled_diloco.runtime import train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                          lock_config=True)
flags.mark_flags_as_required(["config"])


def _override_names(argv: list[str]) -> list[str]:
  """The dotted fields that --config.a.b=v (or -config.a.b v, --noconfig.a.b) overrides."""
  names = []
  for arg in argv[1:]:
    if arg == "--":
      break
    match = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
    if match:
      names.append(match.group(1))
  return names


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError):
    # ml_collections raises these, naming neither the flag nor the config, for an override of a
    # field the config does not have.
    known = settings.config_fields()
    unknown = [name for name in _override_names(argv) if name not in known]
    if not unknown:
      raise
    sys.exit(f"Invalid config: {settings.unknown_field_error(unknown[0])}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  try:
    # A replay takes every field the command line does not set from its recording.
    config = replay_config.with_recording(_CONFIG.value, _override_names(sys.argv))
    run_settings = settings.validate(config)
  except ValueError as err:
    sys.exit(f"Invalid config: {err}")
  try:
    train.train_and_evaluate(run_settings)
  except checkpoints.CheckpointError as err:
    sys.exit(f"Cannot resume: {err}")
  except device_memory.DeviceMemoryError as err:
    sys.exit(f"Invalid config: {err}")
  except event_tape.TapeError as err:
    sys.exit(f"Cannot replay: {err}")
  except event_tape.ReplayDiverged as err:
    sys.exit(f"The replay diverged from its recording: {err}")
  except train.Interrupted as err:
    print(err, file=sys.stderr)
    sys.exit(128 + err.signum)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
