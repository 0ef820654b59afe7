"""metrics.jsonl across a resume: the records' times never run backwards."""

import json
import os

from decoupled_diloco.runtime.core import metrics as metrics_lib


def test_a_resumed_writer_goes_on_after_the_interrupted_runs_last_record(tmp_path):
  """The interrupted run wrote records after its checkpoint's cut (at 5 s) until 9 s; the resumed
  run's first record comes after those, not at 5 s + its own seconds."""
  path = os.path.join(tmp_path, "metrics.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    for t in (1.0, 5.0, 9.0):
      f.write(json.dumps({"kind": "learner", "time_s": t}) + "\n")
  writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False, resume_at_s=5.0)
  writer.write("eval", {"eval_loss": 1.0})
  writer.close()
  times = [r["time_s"] for r in metrics_lib.read_records(str(tmp_path))]
  assert times[:3] == [1.0, 5.0, 9.0] and times[3] >= 9.0


def test_a_fresh_writer_starts_its_file_and_clock_afresh(tmp_path):
  path = os.path.join(tmp_path, "metrics.jsonl")
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps({"kind": "learner", "time_s": 50.0}) + "\n")
  writer = metrics_lib.MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write("eval", {"eval_loss": 1.0})
  writer.close()
  [record] = metrics_lib.read_records(str(tmp_path))
  assert record["time_s"] < 50.0
