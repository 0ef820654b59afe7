r"""Restart time with and without the persistent compilation cache (config.compilation_cache_dir).

Starts the default experiment (experiments/tiny_cpu.py, its model, meshes and sync settings; a
few steps, no checkpoints) in fresh processes, as a restarted or resumed job starts:
  - `none`: no persistent cache, every program compiled;
  - `cold`: an empty cache directory, every program compiled and written to it;
  - `warm`: the same directory again, every program read back;
and gives, for each, the seconds from the process's start (before JAX is imported) to the first
completed learner step, and the build's compile split. The ratio warm / none is taken within one
invocation, the processes one after another.

It also runs, in one process each on the warm cache, the same experiment with and without a
learner crash (`crash@learner=1,step=2`), counting the programs JAX fetches (compiles, or reads
from the cache) after training started: what the in-process rejoin of a learner
(runtime/control/supervisor.py) compiles, if anything.

  python scripts/bench_compile_cache.py                  # writes results/compile_cache.json
  python scripts/bench_compile_cache.py --repeats=3      # medians of 3 of each
"""

import time

_PROCESS_START = time.monotonic()

import argparse  # pylint: disable=g-import-not-at-top,wrong-import-position
import json  # pylint: disable=g-import-not-at-top,wrong-import-position
import os  # pylint: disable=g-import-not-at-top,wrong-import-position
import pathlib  # pylint: disable=g-import-not-at-top,wrong-import-position
import shutil  # pylint: disable=g-import-not-at-top,wrong-import-position
import statistics  # pylint: disable=g-import-not-at-top,wrong-import-position
import subprocess  # pylint: disable=g-import-not-at-top,wrong-import-position
import sys  # pylint: disable=g-import-not-at-top,wrong-import-position
import tempfile  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUM_STEPS = 6


def child(cache_dir: str, schedule: str) -> dict:
  """One start of the default experiment in this process; what it measured, as JSON."""
  sys.path.insert(0, str(ROOT))
  import jax  # pylint: disable=g-import-not-at-top
  from jax import monitoring  # pylint: disable=g-import-not-at-top

  from decoupled_diloco import settings as settings_lib  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime.control import run as run_lib  # pylint: disable=g-import-not-at-top
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top

  fetched: list[float] = []  # time.monotonic() of each executable fetched (compiled or cached)
  monitoring.register_event_duration_secs_listener(
      lambda event, _secs, **_: fetched.append(time.monotonic())
      if event == "/jax/core/compile/backend_compile_duration" else None)
  hits = []
  monitoring.register_event_listener(
      lambda event, **_: hits.append(1) if event == "/jax/compilation_cache/cache_hits" else None)
  config = tiny_cpu.get_config()
  workdir = tempfile.mkdtemp(prefix="bench_cc_")
  config.update_from_flattened_dict({
      "workdir": workdir, "num_steps": NUM_STEPS,
      "eval_every": 0, "eval_batches": 1, "inner.warmup_steps": 2, "checkpoint.every_steps": 0,
      "compilation_cache_dir": cache_dir, "chaos.schedule": schedule})
  run = train.build(settings_lib.validate(config))
  summary = train.execute(run, progress=False)
  shutil.rmtree(workdir, ignore_errors=True)
  first_step = min(l.first_step_done_at for l in run_lib.retired(run) + run.learners
                   if l.first_step_done_at is not None)
  return {"to_first_step_s": first_step - _PROCESS_START,
          "build_seconds": run.build_seconds,
          **{k: summary[k] for k in ("init_compile_s", "train_compile_s", "eval_compile_s",
                                     "syncer_compile_s", "rejoins")},
          "programs_fetched_in_build": sum(1 for t in fetched if t < run.started_at),
          "programs_fetched_while_training": sum(1 for t in fetched if t >= run.started_at),
          "persistent_cache_hits": len(hits), "jax": jax.__version__}


def _start(cache_dir: str, schedule: str = "") -> dict:
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  proc = subprocess.run(
      [sys.executable, __file__, "--child", "--cache_dir", cache_dir, "--schedule", schedule],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"the child with cache_dir={cache_dir!r} failed")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--cache_dir", default="none", help=argparse.SUPPRESS)
  parser.add_argument("--schedule", default="", help=argparse.SUPPRESS)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--out", default=str(ROOT / "results" / "compile_cache.json"))
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.cache_dir, args.schedule)))
    return

  runs: dict[str, list[dict]] = {"none": [], "cold": [], "warm": []}
  for _ in range(args.repeats):
    cache = tempfile.mkdtemp(prefix="bench_cc_cache_")
    try:
      runs["none"].append(_start("none"))
      runs["cold"].append(_start(cache))
      runs["warm"].append(_start(cache))
      if not runs.get("restart"):  # the in-process rejoin, once, on the warm cache
        runs["no_crash"] = [_start(cache)]
        runs["restart"] = [_start(cache, "crash@learner=1,step=2,down_s=0.5")]
      entries = len(os.listdir(cache))
    finally:
      shutil.rmtree(cache, ignore_errors=True)
    for name, measured in runs.items():
      print(f"{name:9s} " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in measured[-1].items()), flush=True)
  median = {name: statistics.median(r["to_first_step_s"] for r in measured)
            for name, measured in runs.items()}
  result = {
      "experiment": "experiments/tiny_cpu.py", "num_steps": NUM_STEPS, "repeats": args.repeats,
      "cache_entries": entries, "to_first_step_s": median,
      "ratio_warm_over_none": median["warm"] / median["none"],
      "ratio_cold_over_none": median["cold"] / median["none"],
      "restart_programs_fetched_while_training": runs["restart"][0][
          "programs_fetched_while_training"],
      "no_crash_programs_fetched_while_training": runs["no_crash"][0][
          "programs_fetched_while_training"],
      "runs": runs,
  }
  print(f"time to first step: none {median['none']:.1f} s, cold {median['cold']:.1f} s, warm "
        f"{median['warm']:.1f} s; warm / none {result['ratio_warm_over_none']:.3f}")
  print(f"programs fetched while training: {result['no_crash_programs_fetched_while_training']} "
        f"without a crash, {result['restart_programs_fetched_while_training']} with a learner "
        f"crash and rejoin ({runs['restart'][0]['rejoins']} rejoin)")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
