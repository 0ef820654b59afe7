r"""Learner throughput with the syncer running vs the same learners with no syncer.

Both variants are built in this process from the same config and run alternately (A B A B ...), so
that machine noise hits both alike; the figure is the ratio of median learner steps/s, measured in
the same run. Target: >= 0.97.

  python scripts/bench_overhead.py                       # tiny_cpu, 3 pairs of 150-step runs
  python scripts/bench_overhead.py --repeats=5 --num_steps=300

With `--config.runtime=ray` the pairs are instead the same run (syncer included) with learner
threads and with learner processes (config.runtime=ray), and the figure is processes / threads
(written to results/bench_overhead_ray.json unless --out says otherwise).

With `--tape` the pairs are the same run (syncer included) with config.tape off and on, and the
figure is tape / no tape (results/bench_tape.json; target: >= 0.99).
"""

import json
import os
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags
from absl import logging

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import devices  # pylint: disable=g-import-not-at-top
from experiments import tiny_cpu

_REPEATS = flags.DEFINE_integer("repeats", 3, "Pairs of runs (no syncer, syncer).")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 150, "Inner steps per learner in each run.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 10, "Leading steps of each learner left out.")
_OUT = flags.DEFINE_string("out", "", "Where to write the result (default: results/"
                           "bench_overhead.json, or bench_overhead_ray.json with runtime=ray).")
_TAPE = flags.DEFINE_bool("tape", False, "Compare config.tape=False and True instead.")
_RUNTIME = flags.DEFINE_enum("config.runtime", "threads", ["threads", "ray"],
                             "threads: syncer vs no syncer; ray: learner processes vs threads.")


def _steps_per_s(run, warmup: int) -> float:
  """Median over learners of steps / time, after each learner's first `warmup` steps."""
  rates = sorted(len(l.step_times[warmup:]) / sum(l.step_times[warmup:]) for l in run.learners)
  return rates[len(rates) // 2] if len(rates) % 2 else sum(rates[len(rates) // 2 - 1:][:2]) / 2


def main(argv):
  del argv
  config = tiny_cpu.get_config()
  config.num_steps = _NUM_STEPS.value
  config.eval_every = 0
  config.log_every = 10_000
  devices.request_fake_cpu_devices(config.devices.num_fake_cpu_devices)
  from decoupled_diloco import settings  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train
  import jax  # pylint: disable=g-import-not-at-top
  cache = os.path.join("/tmp", "decoupled_diloco_jax_cache")
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  start = time.perf_counter()
  processes, taping = _RUNTIME.value == "ray", _TAPE.value
  base, other = (("threads", "ray") if processes else ("no_tape", "tape") if taping
                 else ("no_syncer", "syncer"))
  out = _OUT.value or ("results/bench_overhead_ray.json" if processes else
                       "results/bench_tape.json" if taping else "results/bench_overhead.json")
  rates = {base: [], other: []}
  merges = []
  for rep in range(_REPEATS.value):
    for variant in (base, other):
      config.workdir = f"/tmp/bench_overhead/{variant}_{rep}"
      shutil.rmtree(config.workdir, ignore_errors=True)  # a fresh run, not a resume of an old one
      config.runtime = "ray" if variant == "ray" else "threads"
      config.tape = variant != "no_tape"
      run = train.build(settings.validate(config), with_syncer=variant != "no_syncer")
      summary = train.execute(run, progress=False)
      rates[variant].append(_steps_per_s(run, _WARMUP.value))
      if variant != "no_syncer":
        merges.append(summary["merges"])
      print(f"repeat {rep} {variant:9s}: {rates[variant][-1]:.3f} learner steps/s"
            + (f", {summary['merges']} merges" if variant != "no_syncer" else ""), flush=True)
  pair_ratios = [s / n for s, n in zip(rates[other], rates[base])]
  ratio = sorted(pair_ratios)[len(pair_ratios) // 2]
  result = {
      f"ratio_{other}_over_{base}": ratio,
      "pair_ratios": pair_ratios,
      "steps_per_s": rates,
      "merges_per_run": merges,
      "num_learners": config.num_learners,
      "num_steps": config.num_steps,
      "target": None if processes else 0.99 if taping else 0.97,
      "seconds": time.perf_counter() - start,
      "machine": f"{os.cpu_count()} CPU cores",
  }
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  print(f"learner steps/s {other} / {base}: {ratio:.3f} (median of {len(pair_ratios)} pairs "
        f"{', '.join(f'{r:.3f}' for r in pair_ratios)}"
        f"{'' if processes else '; target >= 0.99' if taping else '; target >= 0.97'}) -> {out}")
  logging.info("wrote %s", out)


if __name__ == "__main__":
  errors.run_main(main)
