"""Replaying a recorded run (config.replay): its tape played on a freshly built run, then the
replay's summary, which says what changed against the recording (runtime/records/event_tape.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

from absl import logging

from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.control import controller
from decoupled_diloco.runtime.control import run as run_lib
from decoupled_diloco.runtime.control import summary as summary_lib
from decoupled_diloco.runtime.records import event_tape
from decoupled_diloco.runtime.records import revision


def replay(run: run_lib.Run, *, progress: bool = True) -> dict[str, Any]:
  """Replays the tape of config.replay on a built run (runtime/records/event_tape.py), evaluates the
  global model and writes the replay's summary, which says what changed against the recording."""
  settings = run.settings
  tape = event_tape.load(settings.replay)
  now = event_tape.settings_record(settings)
  counterfactual = event_tape.counterfactual(tape.config, now)
  for field in counterfactual:
    logging.info("counterfactual replay: config.%s=%s (recorded: %s)", field["field"],
                 field["replayed"], field["recorded"])
  for name in sorted(set(now) - set(tape.config)):
    if name in settings_lib.ADDED_FIELDS:
      logging.info("config.%s is not in the recording (made before the field existed): read as "
                   "%s, the value that run ran as", name, settings_lib.ADDED_FIELDS[name])
  try:
    outcome = event_tape.replay(run, tape, now)
    final = controller.evaluate(run, settings.num_steps, final=True)
  except event_tape.ReplayDiverged as err:
    run.metrics.close()
    here = revision.current()
    if revision.same(tape.revision, here):
      raise
    # Bit for bit holds on the revision that recorded: another one may round differently.
    raise event_tape.ReplayDiverged(
        f"the recording came from {revision.describe(tape.revision)} and this is "
        f"{revision.describe(here)}: a recording replays exactly on the revision that made it; "
        f"{err}") from err
  except BaseException:
    run.metrics.close()
    raise
  summary: dict[str, Any] = {
      "mode": settings.mode, "num_learners": settings.num_learners,
      "replay_of": settings.replay, "replay_exact": outcome.exact,
      # Fields set otherwise than in the recording: those the replay recomputed with, and those
      # that change nothing it computes.
      "replay_changed_fields": outcome.changed["counterfactual"],
      "replay_ignored_fields": outcome.changed["ignored"],
      # The counterfactual fields with their values: field, recorded, replayed (reprs).
      "replay_counterfactual": counterfactual,
      "final_eval_loss": final["eval_loss"],
      "final_validation_loss": final.get("validation_loss"),
      "final_eval_bits_per_byte": final["eval_bits_per_byte"],
      "learner_steps": outcome.steps, "merges": outcome.merges, "replay_rounds": outcome.rounds,
      "replay_takes": outcome.takes, "replay_applies": outcome.applies,
      "replay_respawns": outcome.respawns,
      "replay_seconds": outcome.seconds, "build_seconds": run.build_seconds,
      **summary_lib.params_hashes(run),
  }
  recorded_path = os.path.join(settings.replay, "summary.json")
  if os.path.exists(recorded_path):
    with open(recorded_path, encoding="utf-8") as f:
      recorded = json.load(f)
    summary["recorded_params_sha256"] = recorded.get("params_sha256")
    summary["params_equal_to_recording"] = summary["params_sha256"] == recorded.get(
        "params_sha256")
    summary["recorded_final_eval_loss"] = recorded.get("final_eval_loss")
  run.metrics.flush()
  with open(os.path.join(settings.workdir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2)
  run.metrics.close()
  if progress:
    what = "exact replay" if outcome.exact else (
        "counterfactual replay (" + ", ".join(f"config.{n}" for n in
                                              outcome.changed["counterfactual"]) + " changed)")
    logging.info("%s of %s: %d merges, final eval loss %.4f nats/token (recorded %s), "
                 "params_sha256 %s%s; summary in %s", what, settings.replay, outcome.merges,
                 final["eval_loss"], summary.get("recorded_final_eval_loss"),
                 summary["params_sha256"][:16],
                 "" if "params_equal_to_recording" not in summary else
                 (", equal to the recording's" if summary["params_equal_to_recording"]
                  else ", NOT equal to the recording's"),
                 os.path.join(settings.workdir, "summary.json"))
  return summary
