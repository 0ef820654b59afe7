r"""The runtime's measured goodput beside the goodput simulator's, at a few random-crash rates.

  nice -n 19 .venv/bin/python scripts/bench_sim_to_real.py            # 3 rates, ~12-25 min idle
  nice -n 19 .venv/bin/python scripts/bench_sim_to_real.py --quick    # smoke: 2 rates, few steps

Each rate is one training run (threads runtime, experiments/tiny_cpu.py shrunk: M = 4 learners,
`--num_steps` steps with a fixed extra sleep per step so that a step's duration does not hang on
the model alone, no checkpoints, one eval at the end, H = config.sync.period = 24) with
`config.chaos.mtbf_s` random crashes, Weibull repairs of mean `--repair_s` and shape
`--repair_shape`. The default rates: no crash, and MTBFs such that a learner crashes about 2 and
about 5 times in a run of ~100 s of training (a learner's next failure is drawn from its repair's
end, so it crashes about T / (MTBF + repair) times in T seconds). Five is the most a run this short
takes before the repairs fill it.

The simulator (`sim/elastic_job.py`, each learner an elastic job of one one-chip slice, as
`sim/goodput.py` builds the decoupled system) is then fed the same run: the fault schedule the
runtime realised (each crash's time and repair), the measured step time and the measured restart
(repair -> first step of the new incarnation) as its re-configuration pause, over the run's
training window. With the same fault draws there is no sampling noise to average away; a column of
the simulator's own draws (`--sim_seeds` seeds of the same MTBF and repair law) is printed too.

Four simulator columns, adding one `DecoupledOptions` term at a time:
  * the paper's model: a crash loses the step in flight;
  * + unmerged (`sync_period_steps` = H): a crash also loses every fragment's progress since the
    syncer last took it in, n - n²/2H steps n steps after a restart, H/2 beyond; the runtime's
    measured loss per crash (`lost_fragment_tokens`) is printed beside the simulator's;
  * + discard (`receive_lag_steps` = d): the overwrite on receive
    (config.merge.keep_in_flight_progress=False) drops d of every H steps. d is calibrated once, on
    the fault-free run (else the one with the fewest crashes): d = H × discarded / compute time;
  * + budget, the full model (`steps_per_learner` = the run's num_steps, at its measured step
    time): a learner that has made its steps is done and waits for the last one (FINISHED), and a
    crashed one rejoins at a peer's step, as the runtime's does. residual = full model - runtime.
The runtime's `idle` (before a learner's first step, after its last) is printed beside the
simulator's FINISHED. The start skew is not modelled (every simulated learner starts at 0; the
window is the run's, so that time lands in FINISHED): the summary gives only the earliest and
latest first-step completion (`first_step_s`, `last_first_step_s`), not each learner's first step,
so it cannot be split off `idle`; their spread is printed.

Writes results/bench_sim_to_real.{json,md} (`--out`). Never imports JAX: the runs are subprocesses
(scripts/framework_runs.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import platform
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
import numpy as np

import framework_runs  # pylint: disable=wrong-import-position
import study_common  # pylint: disable=wrong-import-position
from decoupled_diloco.sim import accounting  # pylint: disable=wrong-import-position
from decoupled_diloco.sim.cluster import SECONDS_PER_YEAR, ClusterParams
from decoupled_diloco.sim.elastic_job import simulate_elastic_job
from decoupled_diloco.sim.goodput import DecoupledOptions

_MTBFS = flags.DEFINE_list("mtbfs", ["0", "47", "17"],
                           "Mean seconds between a learner's crashes, one run each; 0 = none.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 200, "Inner steps per learner.")
_STEP_DELAY = flags.DEFINE_float("step_delay_s", 0.25, "Extra sleep per step of every learner.")
_REPAIR_S = flags.DEFINE_float("repair_s", 3.0, "Mean repair time of a crash (config.chaos).")
_REPAIR_SHAPE = flags.DEFINE_float("repair_shape", 0.85, "Weibull shape of the repairs.")
_CHAOS_SEED = flags.DEFINE_integer("chaos_seed", 0, "config.chaos.seed of every run.")
_SIM_SEEDS = flags.DEFINE_integer("sim_seeds", 20, "Seeds of the simulator's own draws.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 900.0, "Kill a run after this many seconds.")
_QUICK = flags.DEFINE_bool("quick", False, "Smoke run: 40 steps, rates 0 and 10 s.")
_OUT = flags.DEFINE_string("out", "results/bench_sim_to_real", "Writes OUT.json and OUT.md.")

NUM_LEARNERS = 4
BATCH_SIZE, SEQ_LEN = 16, 128  # tiny_cpu's, set on every run: tokens per learner step
SYNC_PERIOD = 24  # H, tiny_cpu's, set on every run: each fragment is taken in every H steps


def overrides(mtbf_s: float, num_steps: int, step_delay_s: float, repair_s: float,
              repair_shape: float, chaos_seed: int) -> dict[str, Any]:
  """The config overrides of one run (tiny_cpu shrunk, study_common.QUIET: no checkpoints)."""
  return {**study_common.QUIET,
          "num_learners": NUM_LEARNERS, "num_steps": num_steps, "eval_every": 0,
          "eval_batches": 1, "data.batch_size": BATCH_SIZE, "data.seq_len": SEQ_LEN,
          "sync.period": SYNC_PERIOD, "log_every": max(num_steps // 4, 1), "max_restarts": 1000,
          "learner_step_delays_s": (step_delay_s,) * NUM_LEARNERS,
          "chaos.mtbf_s": mtbf_s, "chaos.repair_s": repair_s,
          "chaos.repair_shape": repair_shape, "chaos.seed": chaos_seed}


@dataclasses.dataclass(frozen=True)
class Measured:
  """What the simulator needs from one run, read off its summary.json."""

  window_s: float  # the training window every learner's time buckets cover
  num_steps: int  # config.num_steps: the step every learner ends at
  step_s: float  # mean wall time of a step (compute buckets / steps made)
  restart_s: float  # mean repair -> first step of the next incarnation
  unmerged_lost_steps: float  # mean steps of work lost per crash besides the step in flight
  crashes: dict[int, list[tuple[float, float]]]  # learner -> [(failed at s, repair s)]
  goodput: float
  buckets: dict[str, float]  # each time bucket's share of all learner time
  first_steps_spread_s: float | None = None  # last - first learner's first step done; None: n/a

  @property
  def num_crashes(self) -> int:
    return sum(len(c) for c in self.crashes.values())


def measure(summary: Mapping[str, Any], tokens_per_step: int = BATCH_SIZE * SEQ_LEN) -> Measured:
  """The runtime's parameters and goodput, from one run's summary."""
  buckets = {int(m): b for m, b in summary["time_buckets"].items()}
  total = sum(sum(b.values()) for b in buckets.values())
  compute = sum(b["useful"] + b["discarded"] + b["lost_progress"] for b in buckets.values())
  steps_made = summary["tokens_trained"] / tokens_per_step  # over learners and incarnations
  failures = summary["failures"]
  crashes: dict[int, list[tuple[float, float]]] = {m: [] for m in buckets}
  for f in failures:  # never repaired (config.max_restarts): down to the end
    repair = f["repaired_at_s"] - f["failed_at_s"] if "repaired_at_s" in f else math.inf
    crashes[int(f["learner"])].append((float(f["failed_at_s"]), float(repair)))
  restarted = sum(1 for f in failures if "repaired_at_s" in f)
  # A failure's lost fragment-tokens: what its fragments held that no merge took in.
  lost_steps = sum(f.get("lost_fragment_tokens", 0) for f in failures) / (
      summary["num_fragments"] * tokens_per_step)
  shares = {k: sum(b[k] for b in buckets.values()) / total for k in next(iter(buckets.values()))}
  first, last = summary.get("first_step_s"), summary.get("last_first_step_s")
  return Measured(
      window_s=total / len(buckets), num_steps=int(max(summary["learner_steps"])),
      step_s=compute / steps_made,
      restart_s=sum(b["restart"] for b in buckets.values()) / restarted if restarted else 0.0,
      unmerged_lost_steps=lost_steps / len(failures) if failures else 0.0,
      crashes=crashes, goodput=float(summary["goodput"]), buckets=shares,
      first_steps_spread_s=None if first is None or last is None else last - first)


def calibration_run(runs: Sequence[tuple[float, Measured]]) -> tuple[float, Measured]:
  """The (MTBF, run) the receive lag is read off: the fault-free run (MTBF 0), else the run with
  the fewest crashes, where the overwrite's discard is least mixed with crash losses."""
  return min(runs, key=lambda run: (run[0] != 0, run[1].num_crashes))


def calibrate_receive_lag(measured: Measured, period_steps: int) -> float:
  """d, the steps of a fragment's progress the overwrite on receive drops at each of its merges:
  it drops d of every H steps' work, so d = H × discarded / (useful + discarded + lost)."""
  b = measured.buckets
  return period_steps * b["discarded"] / (b["useful"] + b["discarded"] + b["lost_progress"])


def cluster_params(measured: Measured, *, mtbf_s: float, repair_s: float,
                   repair_shape: float) -> ClusterParams:
  """One learner = one one-chip slice: per-chip MTBI = the learner's MTBF, the repair law of
  config.chaos, the measured restart as the re-configuration pause, the measured step time."""
  return ClusterParams(
      mtbi_years=(mtbf_s if mtbf_s > 0 else 1e30) / SECONDS_PER_YEAR, slice_chips=1,
      weibull_shape=repair_shape, repair_s=repair_s, reconfig_s=measured.restart_s,
      restart_s=0.0, step_s=measured.step_s)


class Replay(NamedTuple):
  """The simulator on one run's crash schedule."""

  goodput: float
  lost_steps: float  # LOST_PROGRESS over the learners, in steps
  crashes: int  # crashes that hit a running (or restarting) learner
  finished: float  # FINISHED's share of all learner time (learners done with their steps)


def simulate_replay(measured: Measured, params: ClusterParams,
                    options: DecoupledOptions) -> Replay:
  """The simulator on the fault schedule the run realised: every crash at the time it fired,
  repaired as long as it was, every restart its measured mean (so no randomness, and the same
  pauses whatever `options` add)."""
  fixed = dataclasses.replace(params, weibull_shape=math.inf)
  traces = []
  for m in sorted(measured.crashes):
    crashes = [(t, d) for t, d in measured.crashes[m] if t < measured.window_s]
    traces.append(simulate_elastic_job(
        1, fixed, measured.window_s, np.random.default_rng(m),
        failure_times_s=[t for t, _ in crashes],
        repair_durations_s=[min(d, 2 * measured.window_s) for _, d in crashes],
        **options.learner_terms(params.step_s)))
  return Replay(goodput=accounting.goodput(traces),
                lost_steps=sum(tr.badput[accounting.LOST_PROGRESS] for tr in traces) / params.step_s,
                crashes=sum(tr.num_failures for tr in traces),
                finished=accounting.badput_shares(traces)[accounting.FINISHED])


def simulate_drawn(measured: Measured, params: ClusterParams, options: DecoupledOptions, *,
                   seeds: int) -> tuple[float, float, float]:
  """Goodput mean and standard deviation, and the mean crash count, over `seeds` of the
  simulator's own draws of the same law, over the run's window."""
  values, crashes = [], []
  for seed in range(seeds):
    root = np.random.SeedSequence([seed, NUM_LEARNERS])
    traces = [simulate_elastic_job(1, params, measured.window_s, np.random.default_rng(child),
                                   **options.learner_terms(params.step_s))
              for child in root.spawn(NUM_LEARNERS)]
    values.append(accounting.goodput(traces))
    crashes.append(sum(tr.num_failures for tr in traces))
  return float(np.mean(values)), float(np.std(values)), float(np.mean(crashes))


def row(mtbf_s: float, measured: Measured, *, period_steps: int, receive_lag_steps: float,
        repair_s: float, repair_shape: float, sim_seeds: int) -> dict[str, Any]:
  """One rate: the runtime's goodput and the simulator's, adding one term at a time."""
  params = cluster_params(measured, mtbf_s=mtbf_s, repair_s=repair_s, repair_shape=repair_shape)
  paper = simulate_replay(measured, params, DecoupledOptions())
  unmerged = simulate_replay(measured, params, DecoupledOptions(sync_period_steps=period_steps))
  discard_options = DecoupledOptions(sync_period_steps=period_steps,
                                     receive_lag_steps=receive_lag_steps)
  discard = simulate_replay(measured, params, discard_options)
  full_options = dataclasses.replace(discard_options, steps_per_learner=measured.num_steps)
  full = simulate_replay(measured, params, full_options)
  drawn, drawn_std, drawn_crashes = simulate_drawn(
      measured, params, full_options, seeds=sim_seeds) if sim_seeds else (None, None, None)
  # The same pauses in both replays, so the same steps in flight: the difference is the term's.
  sim_lost = (unmerged.lost_steps - paper.lost_steps) / unmerged.crashes if unmerged.crashes else 0.0
  return {
      "mtbf_s": mtbf_s, "crashes": measured.num_crashes,
      "window_s": round(measured.window_s, 2), "step_s": round(measured.step_s, 4),
      "restart_s": round(measured.restart_s, 3),
      "unmerged_lost_steps": round(measured.unmerged_lost_steps, 2),
      "sim_unmerged_lost_steps": round(sim_lost, 2),
      "runtime": measured.goodput, "sim_paper": round(paper.goodput, 4),
      "sim_unmerged": round(unmerged.goodput, 4), "sim_discard": round(discard.goodput, 4),
      "sim_full": round(full.goodput, 4),
      "sim_drawn": None if drawn is None else round(drawn, 4),
      "sim_drawn_std": None if drawn_std is None else round(drawn_std, 4),
      "sim_drawn_crashes": None if drawn_crashes is None else round(drawn_crashes, 1),
      "diff_paper_pts": round(100 * (paper.goodput - measured.goodput), 2),
      "diff_unmerged_pts": round(100 * (unmerged.goodput - measured.goodput), 2),
      "diff_discard_pts": round(100 * (discard.goodput - measured.goodput), 2),
      "diff_full_pts": round(100 * (full.goodput - measured.goodput), 2),
      "idle_pts": round(100 * measured.buckets["idle"], 2),
      "sim_finished_pts": round(100 * full.finished, 2),
      "first_steps_spread_s": (None if measured.first_steps_spread_s is None
                               else round(measured.first_steps_spread_s, 3)),
      # What the full model still gets wrong: the start skew, and what no term models.
      "residual_pts": round(100 * (full.goodput - measured.goodput), 2),
      "runtime_buckets": {k: round(v, 4) for k, v in measured.buckets.items()},
  }


def table(rows: Sequence[Mapping[str, Any]]) -> str:
  """The markdown table of the rows (goodput in %, differences in points, sim - runtime)."""
  def pct(x):
    return "n/a" if x is None else f"{100 * x:.1f}"
  lines = ["| MTBF s | crashes | step s | restart s | unmerged steps lost/crash runtime | sim | "
           "runtime % | sim, paper's model % | + unmerged % | + discard % | + budget (full) % | "
           "full model drawn % | idle pts runtime | finished pts sim | first steps spread s | "
           "residual pts |",
           "|---" * 16 + "|"]
  for r in rows:
    drawn = "n/a" if r["sim_drawn"] is None else (
        f"{pct(r['sim_drawn'])} ± {100 * r['sim_drawn_std']:.1f} "
        f"({r['sim_drawn_crashes']:.0f} crashes)")
    spread = "n/a" if r["first_steps_spread_s"] is None else f"{r['first_steps_spread_s']:.1f}"
    lines.append(
        f"| {r['mtbf_s']:g} | {r['crashes']} | {r['step_s']:.3f} | {r['restart_s']:.2f} | "
        f"{r['unmerged_lost_steps']:.1f} | {r['sim_unmerged_lost_steps']:.1f} | "
        f"{pct(r['runtime'])} | {pct(r['sim_paper'])} | {pct(r['sim_unmerged'])} | "
        f"{pct(r['sim_discard'])} | {pct(r['sim_full'])} | {drawn} | {r['idle_pts']:.1f} | "
        f"{r['sim_finished_pts']:.1f} | {spread} | {r['residual_pts']:+.1f} |")
  return "\n".join(lines)


def estimate_full_minutes(process_s: Sequence[float], train_s: Sequence[float], steps: int,
                          full_steps: int, full_runs: int) -> float:
  """Minutes of the full bench from a smoke run: the per-run overhead (start-up, build, final
  eval) as measured, the training time scaled by steps, times the full bench's runs."""
  overhead = float(np.mean([p - t for p, t in zip(process_s, train_s)]))
  train = float(np.mean(train_s)) * full_steps / steps
  return full_runs * (overhead + train) / 60.0


def note(*, period_steps: int, receive_lag_steps: float, calibrated_on: float, num_steps: int,
         sim_seeds: int) -> str:
  """The md's paragraph: what each simulator term is, and which input was calibrated where."""
  return (
      "Every simulator column replays the crash schedule each run realised (each crash's time and "
      "repair), with that run's measured step time and restart (repair -> first step) as its "
      "re-configuration pause. The paper's model: a crash loses the step in flight. + unmerged: "
      f"it also loses every fragment's progress since the syncer last took it in (H = "
      f"{period_steps} steps, config.sync.period), on average n - n²/2H steps n steps after the "
      "learner's restart and H/2 beyond (a continuous approximation of even staggering); the "
      "runtime's mean loss per crash (lost_fragment_tokens) is set beside the simulator's. "
      "+ discard: the overwrite on receive (config.merge.keep_in_flight_progress="
      f"False) drops d of every H steps of work, d = {receive_lag_steps:.2f} steps calibrated once "
      f"on the MTBF {calibrated_on:g} run (H × discarded / compute time) and used unchanged at "
      f"every rate. + budget (the full model): a learner that has made its {num_steps} steps (at "
      "the measured step time) is done and waits for the last one until the run's window ends "
      "(the simulator's FINISHED, beside the runtime's idle), and a crashed learner rejoins at the "
      "step of a peer that never stopped, read at its repair, as the runtime's rejoiner takes its "
      "healthiest peer's step. residual = full model - runtime, nothing subtracted. Not modelled: "
      "the start skew (every simulated learner starts at 0, and as the window is the run's that "
      "time lands in FINISHED); the summary gives only the first and last learner's first-step "
      "completion, so the runtime's idle cannot be split into start and end: their spread is "
      "printed. Full model drawn: the "
      "simulator's own draws of the same crash and repair law, mean ± std over "
      f"{sim_seeds} seeds, and their mean crash count: config.chaos.seed draws one sample of that "
      "law per run, so the realised crashes can sit well off it.")


def main(argv):
  del argv
  mtbfs = [0.0, 10.0] if _QUICK.value else [float(x) for x in _MTBFS.value]
  num_steps = 40 if _QUICK.value else _NUM_STEPS.value
  started = time.perf_counter()
  runs, process_s, train_s, commands = [], [], [], []
  for mtbf in mtbfs:
    cfg = overrides(mtbf, num_steps, _STEP_DELAY.value, _REPAIR_S.value, _REPAIR_SHAPE.value,
                    _CHAOS_SEED.value)
    workdir = f"/tmp/bench_sim_to_real/mtbf_{mtbf:g}"
    commands.append(" ".join(shlex.quote(a) for a in study_common.command(cfg)))
    summary = framework_runs.framework_run(f"mtbf_{mtbf:g}", {
        k: study_common._flag_value(v) for k, v in cfg.items()},  # pylint: disable=protected-access
        workdir, _TIMEOUT.value)
    if summary["status"] != "done":
      raise RuntimeError(f"run at mtbf_s={mtbf:g} {summary['status']}: see {workdir}/log.txt\n"
                         + summary.get("log_tail", ""))
    measured = measure(summary)
    runs.append((mtbf, measured))
    process_s.append(summary["process_seconds"])
    train_s.append(summary["train_seconds"])
    print(f"MTBF {mtbf:g} s: goodput {100 * measured.goodput:.1f}%, "
          f"{measured.num_crashes} crashes", flush=True)
  calibrated_on, base = calibration_run(runs)
  receive_lag = calibrate_receive_lag(base, SYNC_PERIOD)
  rows = [row(mtbf, measured, period_steps=SYNC_PERIOD, receive_lag_steps=receive_lag,
              repair_s=_REPAIR_S.value, repair_shape=_REPAIR_SHAPE.value,
              sim_seeds=_SIM_SEEDS.value) for mtbf, measured in runs]
  minutes = estimate_full_minutes(process_s, train_s, num_steps, _NUM_STEPS.value,
                                  len(_MTBFS.value))
  report = {
      "date": time.strftime("%Y-%m-%d %H:%M"),
      "machine": f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
      "command": " ".join(shlex.quote(a) for a in sys.argv),
      "quick": _QUICK.value, "num_steps": num_steps, "num_learners": NUM_LEARNERS,
      "sync_period_steps": SYNC_PERIOD, "receive_lag_steps": round(receive_lag, 3),
      "receive_lag_calibrated_on_mtbf_s": calibrated_on,
      "step_delay_s": _STEP_DELAY.value, "repair_s": _REPAIR_S.value,
      "repair_shape": _REPAIR_SHAPE.value, "chaos_seed": _CHAOS_SEED.value,
      "sim_seeds": _SIM_SEEDS.value, "rows": rows, "run_commands": commands,
      "seconds": round(time.perf_counter() - started, 1),
      "estimated_full_bench_min": round(minutes, 1),
  }
  markdown = "\n".join([
      f"Runtime goodput against the simulator's, {NUM_LEARNERS} learners, {num_steps} steps, "
      f"repairs of mean {_REPAIR_S.value:g} s (Weibull shape {_REPAIR_SHAPE.value:g}); "
      f"{report['date']}, {report['machine']}.", "",
      f"`{report['command']}`", "",
      table(rows), "",
      note(period_steps=SYNC_PERIOD, receive_lag_steps=receive_lag, calibrated_on=calibrated_on,
           num_steps=num_steps, sim_seeds=_SIM_SEEDS.value), "",
      f"Whole bench {report['seconds'] / 60:.1f} min; the full bench ({len(_MTBFS.value)} rates, "
      f"{_NUM_STEPS.value} steps) is estimated at {minutes:.0f} min on this machine as loaded now."])
  out = study_common.ROOT / _OUT.value
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
  out.with_suffix(".md").write_text(markdown + "\n", encoding="utf-8")
  print(markdown)


if __name__ == "__main__":
  app.run(main)
