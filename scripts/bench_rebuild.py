r"""What a second build in the same process costs when only the learning-rate schedule differs.

The inner schedule is an argument of the learners' compiled step (`inner.InnerOptimizer`), so a
run that differs from the one before only in `num_steps`, `inner.learning_rate`,
`inner.warmup_steps` or `inner.final_lr_fraction` (a study's grid, a resumed run given more steps)
takes the compiled program again. This builds the default experiment (experiments/tiny_cpu.py,
no persistent compilation cache, nothing trained) three times in one process:
  - `first`: every program compiled;
  - `other_schedule`: twice the steps, another learning rate and warmup;
  - `other_model`: another mlp_dim (the learners' step must compile again: the control);
and prints each build's seconds and the learners' compile seconds, and the ratios to `first`.

  python scripts/bench_rebuild.py          # writes results/rebuild.json
"""

import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decoupled_diloco import settings as settings_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top,wrong-import-position
from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top,wrong-import-position

ARMS = {
    "first": {},
    "other_schedule": {"num_steps": 800, "inner.learning_rate": 1e-2, "inner.warmup_steps": 40},
    "other_model": {"model.mlp_dim": 384},
}


def build_once(overrides: dict) -> dict:
  config = tiny_cpu.get_config()
  config.update_from_flattened_dict({
      "workdir": tempfile.mkdtemp(prefix="bench_rebuild_"), "num_steps": 400,
      "compilation_cache_dir": "none", "checkpoint.every_steps": 0, "tape": False, **overrides})
  started = time.perf_counter()
  run = train.build(settings_lib.validate(config))
  seconds = time.perf_counter() - started
  learner_compile_s = run.compile_seconds["train_compile_s"]
  run.metrics.close()  # built, never started: no thread to stop
  return {"build_s": round(seconds, 2), "learner_compile_s": round(learner_compile_s, 2)}


def main() -> None:
  results = {}
  for name, overrides in ARMS.items():
    results[name] = {"overrides": overrides, **build_once(overrides)}
    print(f"{name:15s} build {results[name]['build_s']:6.2f} s, learners' step compile "
          f"{results[name]['learner_compile_s']:6.2f} s", flush=True)
  for name in ("other_schedule", "other_model"):
    results[name]["build_vs_first"] = round(results[name]["build_s"] / results["first"]["build_s"], 3)
    print(f"{name} / first: build {results[name]['build_vs_first']}")
  out = ROOT / "results" / "rebuild.json"
  out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
