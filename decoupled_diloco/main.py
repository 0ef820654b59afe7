r"""Entry point: python -m decoupled_diloco.main --config=experiments/tiny_cpu.py [--config.a.b=v].

  --help_config   every config field with its value and a one-line description
  --debug         a traceback instead of one line, for a bug report

Only parses flags and validates the config; the run lives in `runtime.train.train_and_evaluate`. A
mistake of the user's (a field, a data source, a checkpoint to resume) ends in one line that names
it, exit status 2, before anything compiles, and leaves behind no workdir that was not there before.
"""

import os
import shutil
import sys

from decoupled_diloco import command_line
from decoupled_diloco import errors
from decoupled_diloco import replay_config
from decoupled_diloco import settings
from decoupled_diloco.runtime.core import pathways
from decoupled_diloco.runtime.records import checkpoints
from decoupled_diloco.runtime.records import event_tape
from decoupled_diloco.runtime import train

# What a start-up failure's line begins with; any other input error is "Invalid config".
_PREFIXES = ((checkpoints.CheckpointError, "Cannot resume"),
             (event_tape.TapeError, "Cannot replay"),
             (pathways.PathwaysUnavailable, "Cannot start under Pathways"))


def _remove_stub(workdir: str) -> None:
  """Removes the workdir this invocation created before it failed at start-up: its tb/, empty
  metrics.jsonl and one-line tape are no run, and the next try would take them for one."""
  checkpoint_dir = os.path.join(workdir, "checkpoints")
  if os.path.exists(os.path.join(workdir, "summary.json")) or (
      os.path.isdir(checkpoint_dir) and os.listdir(checkpoint_dir)):
    return  # it got far enough to save something: never delete that
  shutil.rmtree(workdir, ignore_errors=True)


def main(argv):
  if len(argv) > 1:
    raise errors.InputError(f"Unexpected arguments {argv[1:]}: config overrides take the form "
                            f"--config.FIELD=VALUE")
  if command_line.HELP_CONFIG.value:
    print(command_line.fields_listing())
    return 0
  try:
    # A replay takes every field the command line does not set from its recording.
    config = replay_config.with_recording(command_line.CONFIG.value,
                                          command_line.override_names(sys.argv))
    run_settings = settings.validate(config)
  except event_tape.TapeError as err:
    raise errors.InputError(f"Cannot replay: {err}") from err
  except ValueError as err:
    raise errors.InputError(f"Invalid config: {err}") from err
  workdir_existed = os.path.exists(run_settings.workdir)
  try:
    train.train_and_evaluate(run_settings)
  except (errors.InputError, checkpoints.CheckpointError) as err:
    if not workdir_existed and os.path.isdir(run_settings.workdir):
      _remove_stub(run_settings.workdir)
    prefix = next((p for cls, p in _PREFIXES if isinstance(err, cls)), "Invalid config")
    raise errors.InputError(f"{prefix}: {err}") from err
  except event_tape.ReplayDiverged as err:
    sys.exit(f"The replay diverged from its recording: {err}")
  except train.Interrupted as err:
    print(err, file=sys.stderr)
    sys.exit(128 + err.signum)
  return 0


def run(argv: list[str] | None = None) -> None:
  """The command: `main` behind the framework's flag parsing and one-line errors."""
  errors.run_main(main, argv=argv, flags_parser=command_line.parse_flags,
                  usage=lambda: command_line.usage(__doc__),
                  # Training itself takes a Ctrl-C as a stop with a checkpoint (train.Interrupted);
                  # this is one before or after it, while the run is built or evaluated last.
                  interrupted="Interrupted (SIGINT) outside training (building the run, or its "
                              "final evaluation): nothing was saved for it")


if __name__ == "__main__":
  run()
