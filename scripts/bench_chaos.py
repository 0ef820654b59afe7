r"""One fault schedule, three modes: what each does with it (docs/failures.md).

  .venv/bin/python scripts/bench_chaos.py [--modes=decoupled,diloco,dp] [--num_steps=300]
  .venv/bin/python scripts/bench_chaos.py --config.runtime=ray --modes=decoupled \
      --out=results/chaos_ray    # learner processes: every crash a real SIGKILL

Every learner crashes twice, one hangs, one is cut off by a partition and the syncer crashes once,
at the same seconds into training in every mode (`SCHEDULE`). Each mode runs the default
experiment (experiments/tiny_cpu.py; dp: its data-parallel baseline, one learner on all the
devices, `experiments/dp_baseline_cpu.py`) for the same number of steps, with whole-job
checkpoints every 50 steps, and answers the faults its own way: decoupled keeps training and
rejoins, diloco's learners wait at the barrier for the missing one, dp stops and restarts from its
newest checkpoint. A fault of a kind a mode has no part for is mapped to what it is there (dp has
one learner, so any learner's crash or hang is the job's; it has no syncer and no learner-syncer
link, so those faults do not exist there) and the mapping is written down.

Writes results/chaos.json, results/chaos.md (goodput, uptime, tokens, final eval loss, wall time,
and each mode's eval loss at the wall time the fastest one finished in) and
results/chaos_loss_vs_time.png (eval loss against seconds of training, one line per mode, faults
marked).
"""

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from ml_collections import config_flags

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import devices  # pylint: disable=g-import-not-at-top

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CONFIG = config_flags.DEFINE_config_file("config", str(_ROOT / "experiments" / "tiny_cpu.py"),
                                          "Base experiment; its mode is overridden per run.")
_MODES = flags.DEFINE_list("modes", ["decoupled", "diloco", "dp"], "Modes to compare.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 300, "Inner steps per learner (dp: its steps).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 25, "Steps between evaluations (the curve).")
_SCALE = flags.DEFINE_float("time_scale", 1.0, "Multiplies every fault's second (slower hosts).")
_OUT = flags.DEFINE_string("out", "results/chaos", "Writes OUT.json, OUT.md, OUT_loss_vs_time.png.")
_KINDS = flags.DEFINE_list("kinds", [], "Fire only these fault kinds of the schedule (empty: all); "
                           "e.g. crash,syncer_crash, what config.runtime=ray fires, to compare the "
                           "two runtimes on the same faults.")

# (kind, learner, second, key=value...): every learner crashes twice, one hang, one partition, one
# syncer crash. Seconds count from the start of training.
SCHEDULE = (
    ("crash", 0, 15, "down_s=5"), ("crash", 1, 30, "down_s=5"), ("crash", 2, 45, "down_s=5"),
    ("crash", 3, 60, "down_s=5"), ("hang", 2, 70, "seconds=5"), ("partition", 3, 80, "seconds=5"),
    ("syncer_crash", None, 90, "down_s=3"), ("crash", 0, 100, "down_s=5"),
    ("crash", 1, 115, "down_s=5"), ("crash", 2, 130, "down_s=5"), ("crash", 3, 145, "down_s=5"),
)


def schedule_for(mode: str, scale: float, runtime: str = "threads") -> tuple[str, list[str]]:
  """The schedule string of `mode`, and what was mapped or left out."""
  events, notes = [], []
  for kind, learner, second, rest in SCHEDULE:
    second = round(second * scale, 3)
    if _KINDS.value and kind not in _KINDS.value:
      notes.append(f"{kind} at {second} s: left out (--kinds)")
      continue
    if runtime == "ray" and kind in ("hang", "partition"):
      notes.append(f"{kind} of learner {learner} at {second} s: not fired by config.runtime=ray "
                   "yet (settings refuse it), left out")
      continue
    if kind == "syncer_crash":
      if mode == "dp":
        notes.append(f"syncer_crash at {second} s: dp has no syncer, left out")
        continue
      if mode != "decoupled":
        notes.append(f"syncer_crash at {second} s: restarting a lock-step syncer is not built "
                     "(settings refuse it), left out")
        continue
      events.append(f"syncer_crash@second={second},{rest}")
      continue
    if kind == "partition" and mode != "decoupled":
      if mode == "dp":
        notes.append(f"partition of learner {learner} at {second} s: dp has no learner-syncer "
                     "link, left out")
        continue
      # A lock-step learner cut off from the others holds the barrier as a hung one does.
      notes.append(f"partition of learner {learner} at {second} s: in {mode}, a hang of that "
                   "learner for the same seconds (its barrier waits either way)")
      kind, rest = "hang", rest
    if mode == "dp":
      if kind == "partition":
        notes.append(f"partition of learner {learner} at {second} s: dp has no learner-syncer "
                     "link, left out")
        continue
      if learner != 0:
        notes.append(f"{kind} of learner {learner} at {second} s: in dp, of the one job")
      learner = 0
    events.append(f"{kind}@learner={learner},second={second},{rest}")
  return ";".join(events), notes


def _records(workdir: str, kind: str) -> list[dict]:
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    records = [json.loads(line) for line in f]
  return [r for r in records if r.get("kind") == kind]


def _curve(workdir: str) -> tuple[list[float], list[float], list[float], float]:
  """(seconds of training at each eval, eval losses, fault seconds, origin) from metrics.jsonl;
  the origin is the first learner record's time (training had started)."""
  steps = _records(workdir, "learner")
  origin = min(r["time_s"] for r in steps) if steps else 0.0
  evals = sorted(_records(workdir, "eval"), key=lambda r: r["time_s"])
  faults = [r["time_s"] - origin for r in _records(workdir, "fault")]
  return ([r["time_s"] - origin for r in evals], [r["eval_loss"] for r in evals], faults, origin)


def _loss_at(times: list[float], losses: list[float], t: float) -> float | None:
  """The newest eval loss at or before `t` seconds (what a user stopping then would have)."""
  known = [l for s, l in zip(times, losses) if s <= t]
  return known[-1] if known else None


def _config(base, mode: str):
  """(the experiment config of `mode`, the notes on how its schedule was mapped)."""
  config = base.copy_and_resolve_references()
  config.mode = mode
  config.num_steps = _NUM_STEPS.value
  config.eval_every = _EVAL_EVERY.value
  config.max_restarts = 1000
  config.checkpoint.every_steps = 50
  config.restore = "none"
  config.workdir = f"/tmp/bench_chaos/{mode}"
  config.chaos.schedule, notes = schedule_for(mode, _SCALE.value, config.runtime)
  return config, notes


def main(argv):
  del argv
  base = _CONFIG.value
  devices.request_fake_cpu_devices(base.devices.num_fake_cpu_devices)
  from decoupled_diloco import settings  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train  # pylint: disable=g-import-not-at-top
  results, curves = {}, {}
  started = time.perf_counter()
  configs = {}
  for mode in _MODES.value:  # every mode's settings checked before the first one runs
    configs[mode] = _config(base, mode)
    settings.validate(configs[mode][0])
  for mode in _MODES.value:
    config, notes = configs[mode]
    if os.path.isdir(config.workdir):
      import shutil  # pylint: disable=g-import-not-at-top
      shutil.rmtree(config.workdir)
    summary = train.train_and_evaluate(settings.validate(config))
    times, losses, fault_times, _ = _curve(config.workdir)
    curves[mode] = (times, losses, fault_times)
    results[mode] = {
        "schedule": config.chaos.schedule, "mapped": notes,
        **{k: summary.get(k) for k in (
            "goodput", "uptime", "tokens_trained", "final_eval_loss", "train_seconds",
            "wall_seconds", "rejoins", "syncer_restarts", "learner_steps", "barrier_wait_seconds",
            "time_buckets", "fragment_token_accounting", "double_merged_offers")},
        "faults_fired": len(summary["faults"]),
        "eval_curve": [[round(t, 2), l] for t, l in zip(times, losses)],
    }
    print(f"{mode:10s} goodput {summary.get('goodput')} uptime {summary.get('uptime')} "
          f"final eval loss {summary['final_eval_loss']:.4f} in {summary['train_seconds']:.0f} s "
          f"of training, {len(summary['faults'])} faults", flush=True)
  budget = min(r["train_seconds"] for r in results.values())
  for mode, r in results.items():
    times, losses, _ = curves[mode]
    r["eval_loss_at_budget"] = _loss_at(times, losses, budget)
  report = {"num_steps": _NUM_STEPS.value, "budget_s": budget, "modes": results,
            "seconds": time.perf_counter() - started, "machine": f"{os.cpu_count()} CPU cores",
            "schedule": [list(e) for e in SCHEDULE], "time_scale": _SCALE.value}
  out = _ROOT / _OUT.value
  out.parent.mkdir(parents=True, exist_ok=True)
  (out.parent / (out.name + ".json")).write_text(json.dumps(report, indent=2) + "\n",
                                                 encoding="utf-8")
  lines = [f"Same fault schedule in every mode ({len(SCHEDULE)} events: each learner crashes "
           "twice, a hang, a partition, a syncer crash), "
           f"{_NUM_STEPS.value} steps each; loss at {budget:.0f} s = the newest eval when the "
           "fastest mode had finished.", "",
           "| mode | goodput | uptime | tokens trained | final eval loss | training s | "
           f"eval loss at {budget:.0f} s | faults fired |", "|---|---|---|---|---|---|---|---|"]
  for mode, r in results.items():
    def fmt(x, spec=".3f"):
      return "n/a" if x is None else format(x, spec)
    lines.append(f"| {mode} | {fmt(r['goodput'])} | {fmt(r['uptime'])} | "
                 f"{r['tokens_trained']:,} | {r['final_eval_loss']:.4f} | "
                 f"{r['train_seconds']:.0f} | {fmt(r['eval_loss_at_budget'], '.4f')} | "
                 f"{r['faults_fired']} |")
  for mode, r in results.items():
    for note in r["mapped"]:
      lines.append(f"\n- {mode}: {note}")
  lines.append(f"\nWhole benchmark {report['seconds'] / 60:.1f} min on {os.cpu_count()} CPU cores.")
  (out.parent / (out.name + ".md")).write_text("\n".join(lines) + "\n", encoding="utf-8")
  print("\n".join(lines))
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for mode, (times, losses, fault_times) in curves.items():
    line, = ax.plot(times, losses, marker="o", markersize=3, label=mode)
    for t in fault_times:
      ax.axvline(t, color=line.get_color(), alpha=0.15, linewidth=1)
  ax.set_xlabel("seconds of training")
  ax.set_ylabel("eval loss (nats/token)")
  ax.set_title("Same faults, three modes (vertical lines: faults as they fired)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(out.parent / (out.name + "_loss_vs_time.png"), dpi=120)


if __name__ == "__main__":
  errors.run_main(main)
