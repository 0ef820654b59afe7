r"""What the event tape adds per learner step, counted rather than raced.

`bench_overhead.py --tape` compares whole runs, whose pairs spread +-5% on 2 shared cores: it
cannot resolve a cost of well under 1%. This times the tape's two pieces on their own (writing one
event, fingerprinting one fragment of the default run's size), counts them in a recorded run's
tape, and prints their share of that run's learner time.

  python scripts/bench_tape_events.py WORKDIR    # a finished run made with config.tape=True
"""

import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # pylint: disable=g-import-not-at-top

from decoupled_diloco.algorithm import tape as tape_lib
from decoupled_diloco.runtime.core import metrics as metrics_lib


def main(workdir: str) -> None:
  with open(os.path.join(workdir, "tape.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  learner_events = sum(r["kind"] in ("take", "apply", "respawn") for r in records)
  merges = [r for r in records if r["kind"] == "merge"]
  fingerprints = sum(len(r["offers"]) + 1 for r in merges)
  steps = sum(summary["learner_steps"])
  step_s = 1.0 / float(np.median(summary["learner_steps_per_s"]))
  fragment = max(1, summary["num_params"] // max(summary["num_fragments"], 1))

  writer = metrics_lib.MetricsWriter(tempfile.mkdtemp(), tensorboard=False, tape=True)
  n = 20_000
  started = time.perf_counter()
  for i in range(n):
    writer.tape_event("take", {"learner": 1, "incarnation": 0, "seq": i, "fragment": 3,
                               "step": 100, "publication": 0, "batches": 101, "data_crc": 1})
  event_s = (time.perf_counter() - started) / n
  writer.close()
  values = {"w": np.random.default_rng(0).random(fragment, dtype=np.float32)}
  started = time.perf_counter()
  for _ in range(2_000):
    tape_lib.fingerprint(values)
  fingerprint_s = (time.perf_counter() - started) / 2_000

  per_step_s = (learner_events * event_s + fingerprints * fingerprint_s) / max(steps, 1)
  result = {"event_us": event_s * 1e6, "fingerprint_us": fingerprint_s * 1e6,
            "fragment_floats": fragment, "events_per_learner_step": learner_events / steps,
            "fingerprints_per_merge": fingerprints / max(len(merges), 1),
            "learner_step_ms": step_s * 1e3, "tape_share_of_step": per_step_s / step_s}
  print(json.dumps(result, indent=2))
  print(f"one event {result['event_us']:.1f} us, one fingerprint {result['fingerprint_us']:.1f} "
        f"us; {result['events_per_learner_step']:.2f} events per learner step, "
        f"{result['fingerprints_per_merge']:.1f} fingerprints per merge, a "
        f"{result['learner_step_ms']:.0f} ms step: the tape is "
        f"{100 * result['tape_share_of_step']:.4f}% of a learner's time")
  os.makedirs("results", exist_ok=True)
  with open("results/tape_events.json", "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)


if __name__ == "__main__":
  if len(sys.argv) != 2:
    sys.exit(__doc__)
  main(sys.argv[1])
