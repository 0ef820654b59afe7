"""The one exception for a mistake the user made and can fix.

Raise `InputError` for a bad input found anywhere after the config is parsed: a data source that is
not text, a scheduled fault the run never reaches, a checkpoint that is not there. The message names
the field or argument and what is allowed. `main.py` and the scripts print it as one line and exit
with status 2, without a traceback (unless `--debug`) and without leaving a stub workdir behind.
Everything else is a bug or a fault of the machine and keeps its traceback.
"""

EXIT_BAD_INPUT = 2


class InputError(ValueError):
  """A user's input is invalid; str(err) is the whole one-line message."""
