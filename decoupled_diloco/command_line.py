"""The command line of `decoupled_diloco.main`: --config and its overrides, and --help_config.

A mistake on it is an `errors.InputError` naming the flag: a missing or absent --config file (which
ml_collections would report later, as a long traceback), an override of a field the config lacks
(which it reports naming neither).
"""

import glob
import os
import re

from absl import flags
from ml_collections import config_flags

from decoupled_diloco import config_help
from decoupled_diloco import errors
from decoupled_diloco import settings

DEFAULT_CONFIG = "experiments/tiny_cpu.py"
CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file (get_config()).",
                                         lock_config=True)
HELP_CONFIG = flags.DEFINE_bool("help_config", False, "List every config field with its value and "
                                "a one-line description, and exit.")


def override_names(argv: list[str]) -> list[str]:
  """The dotted fields that --config.a.b=v (or -config.a.b v, --noconfig.a.b) overrides."""
  names = []
  for arg in argv[1:]:
    if arg == "--":
      break
    match = re.match(r"^--?(?:no)?config\.([^=]+)", arg)
    if match:
      names.append(match.group(1))
  return names


def _config_file(argv: list[str]) -> str | None:
  """The file --config names (without ml_collections' ":arg" suffix), or None without --config."""
  for index, arg in enumerate(argv[1:], 1):
    match = re.match(r"^--?config(?:=(.*))?$", arg)
    if match:
      value = match.group(1) if match.group(1) is not None else (
          argv[index + 1] if index + 1 < len(argv) else "")
      return value.split(":", 1)[0]
  return None


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parse of `argv`, each mistake an InputError that names the flag or the field."""
  path = _config_file(argv)
  if path is None:
    if any(arg in ("--help_config", "-help_config") for arg in argv):
      argv = [*argv, f"--config={DEFAULT_CONFIG}"]  # the default experiment's fields
    else:
      raise errors.InputError(
          f"--config is required: the experiment file whose fields --config.FIELD=VALUE "
          f"overrides, e.g. --config={DEFAULT_CONFIG} (the default experiment)",
          hint=f"--config={DEFAULT_CONFIG} --help_config lists its fields")
  elif not os.path.isfile(path):
    experiments = [p for p in sorted(glob.glob(os.path.join(os.path.dirname(path) or ".", "*.py")))
                   if not os.path.basename(p).startswith("_")]
    raise errors.InputError(
        f"--config={path}: no such file; it takes an experiment config file (its get_config()), "
        f"e.g. {', '.join(experiments) or DEFAULT_CONFIG}")
  try:
    return flags.FLAGS(argv)
  except flags.IllegalFlagValueError as err:
    # absl's "flag --config.num_steps=abc: invalid literal for int()": say it as a config error.
    bad = re.match(r"^flag --config\.([\w.]+)=(.*?): (.*)$", " ".join(str(err).split()))
    if bad is None:
      raise
    name, value, why = bad.groups()
    raise errors.InputError(f"Invalid config: config.{name}={value!r} is invalid: it does not "
                            f"parse as the type the experiment gives the field ({why})") from err
  except (AttributeError, KeyError) as err:
    # ml_collections raises these, naming neither the flag nor the config, for an override of a
    # field the config does not have.
    known = settings.config_fields()
    unknown = [name for name in override_names(argv) if name not in known]
    if not unknown:
      raise
    raise errors.InputError(f"Invalid config: {settings.unknown_field_error(unknown[0])}") from err


def fields_listing() -> str:
  """Every config field of the --config experiment (or the default one) with its description."""
  config = CONFIG.value if flags.FLAGS.is_parsed() else None
  if config is None:
    from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top
    config = tiny_cpu.get_config()
  return config_help.describe_fields(config, settings.config_fields())


def usage(doc: str) -> str:
  """--help and --helpshort: the command's docstring, its flags and the config fields."""
  return (f"{doc.strip()}\n\nFlags: --config=FILE (required), --config.FIELD=VALUE, --help_config, "
          f"--debug; --helpfull lists absl's own too.\n\n{fields_listing()}")
