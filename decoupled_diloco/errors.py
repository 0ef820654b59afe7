"""The one exception for a mistake the user made and can fix, and how a command reports it.

Raise `InputError` for a bad input found anywhere after the config is parsed: a data source that is
not text, a scheduled fault the run never reaches, a checkpoint that is not there. The message names
the field or argument and what is allowed. `main.py` and the scripts print it as one line and exit
with status 2, without a traceback (unless `--debug`) and without leaving a stub workdir behind.
Everything else is a bug or a fault of the machine and keeps its traceback.

`run_main(main)` is `absl.app.run(main)` for every command of the framework: a flag or input error
is one line and exit 2, Ctrl-C before the run handles signals is one line and exit 130, and
`--help` / `--helpshort` print the command's help and exit 0 (absl's exit 1 reads as a failure to
a script that asked for help).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from absl import app
from absl import flags

from decoupled_diloco.runtime.control import quiet_logs

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 128 + 2  # SIGINT's, as a shell reports a Ctrl-C

# absl's help flags: each asks for the command's help, not for a run.
HELP_ARGS = ("--help", "-help", "--helpshort", "-helpshort", "-?", "-h")


class InputError(ValueError):
  """A user's input is invalid; str(err) is the whole one-line message, `hint` an optional second
  line (what to run instead)."""

  def __init__(self, message: str, hint: str = ""):
    super().__init__(message)
    self.hint = hint


def define_debug_flag() -> None:
  """--debug, for every command that reports through `run_main`: errors keep their traceback."""
  if "debug" not in flags.FLAGS:
    flags.DEFINE_bool("debug", False, "Show the traceback of an input error or Ctrl-C instead of "
                      "one line (for a bug report).")


def debugging(argv: Sequence[str] = ()) -> bool:
  """Whether --debug was given: read from `argv` while the flags are not parsed yet."""
  if "debug" in flags.FLAGS and flags.FLAGS.is_parsed():
    return flags.FLAGS.debug
  return any(arg in ("--debug", "-debug", "--debug=true", "--debug=True") for arg in argv)


def report(message: str, hint: str = "", code: int = EXIT_BAD_INPUT) -> NoReturn:
  """Prints `message` as one line (and `hint` as a second) on stderr and exits with `code`."""
  print(" ".join(message.split()), file=sys.stderr)
  if hint:
    print(" ".join(hint.split()), file=sys.stderr)
  sys.exit(code)


def flag_error_message(err: flags.Error) -> str:
  """absl's message for a flag it could not take, as one line that names the flag."""
  text = str(err)
  if "Traceback (most recent call last)" in text:
    # ml_collections puts the config file's traceback in its message: keep the flag and the
    # exception's last line, what the file's get_config() raised.
    lines = [l for l in text.splitlines() if l.strip()]
    text = f"{lines[0].split(': ')[0]}: the config file raised {lines[-1].strip()}"
  message = " ".join(text.split())
  missing = re.search(r"Flag --([\w.]+) must have a value other than None", message)
  if missing:
    name = missing.group(1)
    help_text = flags.FLAGS[name].help if name in flags.FLAGS else ""
    return f"--{name} is required{': ' + help_text if help_text else ''}"
  unknown = re.fullmatch(r"Unknown command line flag '([\w.-]+)'.*", message)
  if unknown:
    return f"--{unknown.group(1)} is not a flag of this command (--helpshort lists them)"
  return re.sub(r"^flag (--\S+): ", r"\1: ", message)


def run_main(main: Callable[[list[str]], object], *, argv: list[str] | None = None,
             flags_parser: Callable[[list[str]], list[str]] | None = None,
             usage: Callable[[], str] | None = None,
             interrupted: str = "Interrupted (SIGINT) before it finished") -> NoReturn:
  """`app.run(main)` with the framework's reporting (module docstring): `flags_parser` parses
  argv (default: absl's), `usage()` is the help text (default: absl's short help), `interrupted`
  the line a Ctrl-C that reaches `main` as KeyboardInterrupt ends in."""
  define_debug_flag()
  argv = list(sys.argv if argv is None else argv)

  def parse(args: list[str]) -> list[str]:
    if any(arg in HELP_ARGS for arg in args[1:]):
      if usage is not None:
        print(usage())
      else:
        app.usage(shorthelp=True, writeto_stdout=True)
      sys.exit(0)
    try:
      return (flags_parser or flags.FLAGS)(args)
    except flags.Error as err:
      if debugging(args):
        raise
      message = flag_error_message(err)
      report(message, "" if "--helpshort" in message else "--helpshort lists the flags")
    except InputError as err:
      if debugging(args):
        raise
      report(str(err), err.hint)

  def guarded(args: list[str]):
    quiet_logs.install(flags.FLAGS.verbosity)  # the libraries' INFO only with --verbosity=1
    try:
      return main(args)
    except app.UsageError as err:  # absl's own usage mistake: unexpected positional arguments
      if debugging():
        raise
      report(f"{err} (options take the form --name=value; --helpshort lists them)")
    except InputError as err:
      if debugging():
        raise
      report(str(err), err.hint)
    except ValueError as err:
      # settings.validate's refusals (every one begins with the field: "config.x=... ") reach
      # here from the scripts that validate a config themselves, not through main.py.
      if debugging() or not str(err).startswith("config."):
        raise
      report(f"Invalid config: {err}")
    except KeyboardInterrupt:
      if debugging():
        raise
      report(interrupted, code=EXIT_INTERRUPTED)

  app.run(guarded, argv=argv, flags_parser=parse)
  sys.exit(0)  # app.run exits itself; for type checkers
