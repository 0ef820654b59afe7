r"""One recorded run, replayed exactly and under other merge rules on the very same arrival pattern.

Records a decoupled run of the given experiment (default: experiments/tiny_cpu.py, the default run),
then replays its tape (runtime/records/event_tape.py): once with the recording's settings (bit for bit: the
same params_sha256), once with merge.rule=average instead of rda, once with merge.weighting=uniform
instead of tokens_sq_over_steps. Every replay follows the recorded pattern: who took part in which
merge, from which of their steps, and when each learner applied which merge. The eval losses go
side by side into results/replay_study.md (and .json).

  python scripts/replay_study.py                          # the default run, 400 steps
  python scripts/replay_study.py --config.num_steps=100   # shorter
"""

import json
import os
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags
from ml_collections import config_flags

from decoupled_diloco import errors

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "tiny_cpu.py"),
    "The experiment to record and replay.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/replay_study", "Where the runs go (replaced).")
_OUT = flags.DEFINE_string("out", "results/replay_study", "Result path, without .md / .json.")

# (label, overrides) of each replay; the first is the exact one.
_REPLAYS = (
    ("exact (recorded settings)", {}),
    ("merge.rule=average", {"merge.rule": "average"}),
    ("merge.weighting=uniform", {"merge.weighting": "uniform"}),
)


def main(argv):
  del argv
  from decoupled_diloco import settings  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime.core import devices
  config = _CONFIG.value
  devices.request_fake_cpu_devices(config.devices.num_fake_cpu_devices)
  from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top
  started = time.perf_counter()
  shutil.rmtree(_WORKDIR.value, ignore_errors=True)
  recording = os.path.join(_WORKDIR.value, "recorded")
  config.workdir, config.tape, config.replay = recording, True, ""
  recorded = train.train_and_evaluate(settings.validate(config))
  rows = [{"run": f"recorded ({config.merge.rule}, {config.merge.weighting})",
           "final_eval_loss": recorded["final_eval_loss"], "merges": recorded["merges"],
           "params_sha256": recorded["params_sha256"], "seconds": recorded["wall_seconds"]}]
  for i, (label, overrides) in enumerate(_REPLAYS):
    replay_config = config.copy_and_resolve_references()
    replay_config.workdir = os.path.join(_WORKDIR.value, f"replay_{i}")
    replay_config.replay = recording
    replay_config.update_from_flattened_dict(overrides)
    summary = train.train_and_evaluate(settings.validate(replay_config))
    rows.append({"run": f"replay: {label}", "final_eval_loss": summary["final_eval_loss"],
                 "merges": summary["merges"], "params_sha256": summary["params_sha256"],
                 "equal_to_recording": summary["params_equal_to_recording"],
                 "changed": summary["replay_changed_fields"],
                 "seconds": summary["replay_seconds"]})
    print(f"{rows[-1]['run']}: eval loss {summary['final_eval_loss']:.4f}, params "
          f"{'equal to' if summary['params_equal_to_recording'] else 'unlike'} the recording's",
          flush=True)
  result = {"experiment": _CONFIG.value.get("experiment_name", "tiny_cpu"),
            "num_steps": config.num_steps, "num_learners": config.num_learners,
            "rows": rows, "seconds": round(time.perf_counter() - started, 1),
            "machine": f"{os.cpu_count()} CPU cores"}
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  lines = [
      "# One recorded run, replayed under other merge rules",
      "",
      f"`python scripts/replay_study.py` ({config.num_learners} learners, {config.num_steps} "
      f"steps, {result['machine']}): the recording's arrival pattern (who took part in which "
      "merge, from which step; when each learner applied each merge) is kept in every replay; "
      "only what the changed setting computes differs.",
      "",
      "| run | final eval loss (nats/token) | merges | params_sha256 | seconds |",
      "|---|---|---|---|---|",
  ]
  for row in rows:
    same = " (= recording)" if row.get("equal_to_recording") else ""
    lines.append(f"| {row['run']} | {row['final_eval_loss']:.4f} | {row['merges']} | "
                 f"`{row['params_sha256'][:12]}`{same} | {row['seconds']:.1f} |")
  with open(_OUT.value + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  errors.run_main(main)
