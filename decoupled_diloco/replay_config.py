"""The config a replay runs with: the recording's, with the command line's overrides on top.

The tape's first record holds every config field of the recorded run (`event_tape.settings_record`),
so `--config.replay=WORKDIR` needs nothing else: each field the command line does not set takes
its recorded value. A field the command line sets wins; if it then differs from the recording, the
replay is a counterfactual one (merge.*, outer.*, compression.*) or, for a field that shapes what
the learners compute, refused by `event_tape.check_replayable`, naming the field.

A few fields belong to the replay itself, not to the recording, and keep the config file's value:
where it writes (workdir, checkpoints, compilation cache, profile), what it resumes, and the
faults, which a replay takes from the tape and never from config.chaos.
"""

import ast
import json
import os
from typing import Sequence

from absl import logging
import ml_collections

from decoupled_diloco.errors import InputError
from decoupled_diloco.runtime.records import event_tape

# Fields of the replay's own (prefixes end with '.'): the recording's would point the replay at
# the recording's workdir and checkpoints, or schedule faults the tape already holds.
OWN_FIELDS = ("workdir", "replay", "restore", "checkpoint.", "compilation_cache_dir",
              "profile_steps", "chaos.", "late_learners", "runtime", "ray.")


def default_workdir(replay: str) -> str:
  """Where a replay writes when the command line names no config.workdir: next to the recording
  (the config file's workdir is usually the recording's own, which a replay may not write)."""
  return os.path.normpath(replay) + "_replay"


def recorded_fields(replay: str) -> dict[str, str] | None:
  """The tape's config record of `replay` (dotted field -> repr), or None where there is no
  readable one: `settings.validate` and `event_tape.load` then refuse it, saying why."""
  path = os.path.join(replay, event_tape.TAPE_FILE)
  try:
    with open(path, encoding="utf-8") as f:
      record = json.loads(f.readline())
  except (OSError, ValueError):
    return None
  if not isinstance(record, dict) or record.get("kind") != "config":
    return None
  return record.get("config")


def with_recording(config: ml_collections.ConfigDict,
                   given: Sequence[str]) -> ml_collections.ConfigDict:
  """`config` with every field of the recording config.replay names, except those in `given`
  (the dotted fields the command line set) and the replay's own. Returns `config` itself when it
  replays nothing."""
  replay = config.get("replay")
  if not isinstance(replay, str) or not replay:
    return config
  recorded = recorded_fields(replay)
  if recorded is None:
    return config
  # Recorded values are the validated ones (tuples where a file may hold lists, a resolved
  # vocabulary size): a copy without type checks takes them as they are; validate checks them.
  out = ml_collections.ConfigDict(config.to_dict(), type_safe=False)
  given = set(given)
  for name, text in recorded.items():
    if name in given or name.startswith(OWN_FIELDS) or not _has_field(out, name):
      continue
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as err:
      raise InputError(f"config.replay={replay!r}: the recorded config.{name}={text} cannot be "
                       f"read back; set config.{name} on the command line") from err
    _set_field(out, name, value)
  if "workdir" not in given:
    out.workdir = default_workdir(replay)
  logging.info("replaying %s with its recorded config (%s); workdir %s", replay,
               "overrides: " + ", ".join(f"config.{n}" for n in sorted(given - {"replay"}))
               if given - {"replay"} else "no overrides", out.workdir)
  return out


def _has_field(config: ml_collections.ConfigDict, name: str) -> bool:
  node = config
  for part in name.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return False
    node = node[part]
  return True


def _set_field(config: ml_collections.ConfigDict, name: str, value) -> None:
  *sections, leaf = name.split(".")
  node = config
  for part in sections:
    node = node[part]
  node[leaf] = value
