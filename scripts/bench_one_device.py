r"""M = 4 learners sharing one device against dp on it, at equal tokens (experiments/one_gpu.py).

Each mode runs in its own process (scripts/framework_runs.py), one after the other:
  - `decoupled`: the four learners of experiments/one_gpu.py taking turns on the one device;
  - `dp`: one data-parallel job on the same device, its batch the four learners' together, so the
    same steps are the same tokens.
For each it prints and writes final eval loss, tokens/s (all learners together, over their step
time, and per device-second as the summary counts it), the first-step time (process start to the
first learner's first step), device peak memory (and what the memory check planned), build and
compile seconds, merges vs due, and the eval loss at every step both modes evaluated, to
results/one_device_<size>.{json,md}, rewritten as each mode finishes. A mode that runs
past its time is stopped and reported from its metrics so far. `--repeats=N` runs the modes N
times, alternately, each pair compared within itself (a shared host's load drifts).

`--compare_own_devices` adds the mode `own_devices`: the same four learners, each on a device of its
own (config.devices.learners_sharing_devices = 1; on a CPU five fake devices, one per learner and
one for the syncer), run between the other modes in the same script. What sharing costs in
goodput is then read within one run of the benchmark: goodput, late offers, the seconds each
bucket got (useful, discarded, idle) and the steps an overwrite discarded per merge applied, for
the sharing learners beside the ones on their own devices (issue 44).

  python scripts/bench_one_device.py                       # on a GPU: the 124M shape, 200 steps
  python scripts/bench_one_device.py --size=cpu --steps=60 # the same layout on one fake CPU device
  python scripts/bench_one_device.py --budget_s=240        # both modes within 4 minutes
  python scripts/bench_one_device.py --size=cpu --compare_own_devices --modes=decoupled --repeats=2

--budget_s bounds the whole script: each mode gets an equal share of what is left (less 10 s to
write the results), or --mode_timeout_s if that is less. Nothing here imports JAX (it would take
the GPU's memory from the runs) or Ray, or reaches the network.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import shutil
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import framework_runs  # pylint: disable=g-import-not-at-top,wrong-import-position

CONFIG = "experiments/one_gpu.py"
# The GPU run's 200 steps are 6.4M tokens, ~6 epochs of the bundled corpus at this size.
DEFAULT_STEPS = {"gpu": 200, "cpu": 200}
MODES = ("decoupled", "dp")
OWN_DEVICES = "own_devices"  # --compare_own_devices: the four learners, each on its own device
_RESERVE_S = 10.0  # of the budget, kept for writing the results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default=None, choices=("gpu", "cpu"),
                      help="experiments/one_gpu.py's shape (default: gpu on a GPU, else cpu)")
  parser.add_argument("--steps", type=int, default=None, help="steps per learner (and of dp)")
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--compare_own_devices", action="store_true",
                      help="also run the learners each on a device of its own (mode own_devices), "
                           "alternately with the others: goodput sharing vs own devices")
  parser.add_argument("--repeats", type=int, default=1,
                      help="run the modes this many times, alternately (a shared host's load "
                           "drifts: each pair's ratio is taken within the pair)")
  parser.add_argument("--budget_s", type=float, default=3600.0, help="the whole script")
  parser.add_argument("--mode_timeout_s", type=float, default=None, help="one mode at most")
  parser.add_argument("--eval_every", type=int, default=None, help="default: steps / 6")
  parser.add_argument("--attention", default=None, help="config.model.attention (e.g. cudnn)")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="another config override for both modes, e.g. syncer.num_workers=8")
  parser.add_argument("--workdir", default="/tmp/bench_one_device")
  parser.add_argument("--out", default=None, help="output prefix (default results/one_device_*)")
  args = parser.parse_args()
  started = time.perf_counter()

  probe = framework_runs.probe("cpu" if args.size == "cpu" else None)
  size = args.size or ("gpu" if probe["platform"] == "gpu" else "cpu")
  if size == "gpu" and probe["platform"] != "gpu":
    sys.exit(f"--size=gpu needs a GPU; this host's first device is {probe['kind']} "
             f"({probe['platform']}): use --size=cpu")
  steps = args.steps or DEFAULT_STEPS[size]
  overrides = {"num_steps": steps, "eval_every": args.eval_every or max(steps // 6, 1),
               "log_every": max(min(25, steps // 10), 1), "checkpoint.every_steps": 0,
               "restore": "none", "inner.warmup_steps": min(30, steps // 4),
               "compilation_cache_dir": os.path.join(args.workdir, "jax_cache")}
  if args.attention:
    overrides["model.attention"] = args.attention
  for item in args.set:
    key, _, value = item.partition("=")
    overrides[key] = value
  modes = args.modes.split(",")
  if args.compare_own_devices and OWN_DEVICES not in modes:
    modes.insert(modes.index("decoupled") + 1 if "decoupled" in modes else len(modes), OWN_DEVICES)
  unknown = sorted(set(modes) - set(MODES) - {OWN_DEVICES})
  if unknown:
    sys.exit(f"--modes: unknown mode(s) {', '.join(unknown)}; the modes are "
             f"{', '.join(MODES + (OWN_DEVICES,))}")
  if OWN_DEVICES in modes and size != "cpu" and probe["count"] < 4:
    sys.exit(f"mode {OWN_DEVICES} needs a device per learner (4); this host has {probe['count']}")
  out = args.out or str(ROOT / "results" / f"one_device_{size}")
  command = "python scripts/bench_one_device.py " + " ".join(sys.argv[1:])
  print(f"{probe['kind']} ({probe['platform']}), experiments/one_gpu.py:{size}, {steps} steps, "
        f"modes {', '.join(modes)}, budget {args.budget_s:.0f} s", flush=True)
  report = {"device": probe, "size": size, "steps": steps, "command": command,
            "date": datetime.date.today().isoformat(), "overrides": overrides, "runs": [],
            "comparison": []}
  order = [(repeat, mode) for repeat in range(args.repeats) for mode in modes]
  for index, (repeat, mode) in enumerate(order):
    left = args.budget_s - (time.perf_counter() - started) - _RESERVE_S
    timeout = left / (len(order) - index)
    if args.mode_timeout_s:
      timeout = min(timeout, args.mode_timeout_s)
    if timeout <= 0:
      report["runs"].append({"mode": mode, "repeat": repeat, "status": "skipped",
                             "why": "no time left of --budget_s"})
      continue
    workdir = os.path.join(args.workdir, mode)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"{mode} (repeat {repeat}): running (at most {timeout:.0f} s)", flush=True)
    summary = framework_runs.framework_run(
        mode, {**overrides, **mode_overrides(mode, size)}, workdir, timeout,
        config=f"{CONFIG}:{size}")
    report["runs"].append({"mode": mode, "repeat": repeat, **figures(summary),
                           **round_figures(workdir)})
    print(f"{mode} (repeat {repeat}): " + ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
        for k, v in report["runs"][-1].items() if not isinstance(v, (list, dict))), flush=True)
    report["comparison"] = [compare({r["mode"]: r for r in report["runs"] if r["repeat"] == n})
                            for n in range(repeat + 1)]
    write(report, out)
  report["seconds"] = time.perf_counter() - started
  write(report, out)
  print(open(out + ".md", encoding="utf-8").read())


def mode_overrides(mode: str, size: str) -> dict:
  """The config of one mode: dp or decoupled as experiments/one_gpu.py has them, or own_devices,
  the decoupled learners each on a device of its own (on a CPU: one fake device per learner and
  one for the syncer, as the sharing learners have one for the four and one for the syncer)."""
  if mode != OWN_DEVICES:
    return {"mode": mode}
  own = {"mode": "decoupled", "devices.learners_sharing_devices": 1}
  if size == "cpu":
    own["devices.num_fake_cpu_devices"] = 5
  return own


def round_figures(workdir: str) -> dict:
  """What the run's own records say of its rounds (decoupled modes; empty for dp).

  From the event tape: the learner steps an overwrite dropped per merge applied (the learner's step
  at the apply less the step of its offer the merge took) and, per take, the batches the learner had
  taken past the step it offered. From metrics.jsonl's merge records of the rounds during training:
  the median seconds from a round's opening to its last offer landing (copy), of the grace window
  it was given, of the merge's wait for a worker (queue) and from closing to broadcast (sync), and
  the mean learners per merge. Together they say whether offers come late because they land after
  the window (copy > grace), or progress is dropped because merges wait (queue)."""
  tape = os.path.join(workdir, "tape.jsonl")
  if not os.path.exists(tape):
    return {}
  dropped, ahead = [], []
  for event in _records(tape):
    if event.get("kind") == "apply" and event.get("merged") is not None:
      dropped.append(event["step"] - event["merged"])
    elif event.get("kind") == "take":
      ahead.append(event["batches"] - event["step"])
  out = {}
  if dropped:
    out["steps_dropped_per_apply"] = sum(dropped) / len(dropped)
  if ahead:
    out["batches_ahead_of_offer"] = sum(ahead) / len(ahead)
  metrics = os.path.join(workdir, "metrics.jsonl")
  merges = [r for r in _records(metrics) if r.get("kind") == "merge" and not r.get("final")]
  if merges:
    for key in ("copy_s", "grace_window_s", "queue_s", "sync_s"):
      out[f"median_{key}"] = statistics.median(r[key] for r in merges)
    out["learners_per_merge"] = sum(len(r["learners"]) for r in merges) / len(merges)
  return out


def _records(path: str) -> list[dict]:
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def figures(summary: dict) -> dict:
  """What the report keeps of one mode's run (of a run that did not finish: its records so far)."""
  keep = {"status": summary["status"], "process_seconds": summary["process_seconds"],
          # From the process's start (imports, build, compile) to the first learner's first step,
          # and to the last one's (four learners on one device make their first steps in turn).
          "process_to_first_step_s": summary["process_to_first_step_s"],
          "process_to_last_first_step_s": summary["process_to_last_first_step_s"],
          "planned_device_bytes": summary["planned_device_bytes"],
          "device_limit_bytes": summary["device_limit_bytes"]}
  if summary["status"] == "done":
    steps = summary["learner_steps"]
    tokens_per_step = summary["tokens_trained"] / max(sum(steps), 1)
    keep.update({
        "final_eval_loss": summary["final_eval_loss"],
        # Every learner's tokens over its own step time, added up: what the device trained.
        "tokens_per_s": tokens_per_step * sum(summary["learner_steps_per_s"]),
        "tokens_per_s_per_device": summary["tokens_per_s_per_device"], "mfu": summary["mfu"],
        "device_peak_bytes": summary["device_peak_bytes"],
        "host_peak_rss_bytes": summary["host_peak_rss_bytes"],
        "tokens_trained": summary["tokens_trained"], "learner_steps": steps,
        "num_params": summary["num_params"], "device_kind": summary["device_kind"],
        # From the start of the build (after the imports).
        "first_step_s": summary.get("first_step_s"),
        "last_first_step_s": summary.get("last_first_step_s"),
        "train_seconds": summary["train_seconds"], "build_seconds": summary["build_seconds"],
        **{k: summary[k] for k in ("init_compile_s", "train_compile_s", "eval_compile_s",
                                   "syncer_compile_s", "merges", "merges_due",
                                   "merges_before_flush", "late_offers", "heartbeat_absences",
                                   "double_merged_offers", "goodput", "stale_answers",
                                   "due_while_in_flight", "rounds_without_quorum",
                                   # Where a short run's idle seconds go: the end after the last
                                   # step (flush included), against the whole wall time.
                                   "wall_seconds", "flush_seconds", "end_seconds", "uptime")
           if k in summary},
        # Seconds of every learner's window in each goodput bucket, summed over learners.
        "buckets_s": {k: round(sum(b[k] for b in summary["time_buckets"].values()), 2)
                      for k in ("useful", "discarded", "idle")} if "time_buckets" in summary
                     else None,
        "evals": [[e["step"], e["eval_loss"]] for e in summary["eval_history"]]})
    return keep
  partial = summary.get("partial", {})
  latest = {}
  for record in partial.get("learner", []):
    latest[record["learner"]] = record
  keep.update({
      "steps_reached": [latest[m]["step"] for m in sorted(latest)],
      # Each learner's rate over its last log_every steps, added up (none from a first step's
      # record alone: its time runs from the start of training).
      "tokens_per_s": sum(r["tokens_per_s"] for r in latest.values())
                      if latest and all(r["step"] > 1 for r in latest.values()) else None,
      "evals": [[e["step"], e["eval_loss"]] for e in partial.get("eval", [])]})
  if summary["status"] == "failed":
    keep["log_tail"] = summary.get("log_tail", "")[-2000:]
  return keep


def compare(modes: dict) -> dict:
  """Decoupled over dp: tokens/s, and eval loss at every step both evaluated (equal tokens); and
  the sharing learners beside the ones on their own devices: goodput and late offers."""
  ratios = {}
  a = modes.get("decoupled")
  own = modes.get(OWN_DEVICES)
  if a is not None and own is not None:
    if a.get("goodput") is not None and own.get("goodput") is not None:
      ratios["goodput_sharing_minus_own_devices"] = a["goodput"] - own["goodput"]
    if a.get("tokens_per_s") and own.get("tokens_per_s"):
      ratios["tokens_per_s_sharing_over_own_devices"] = a["tokens_per_s"] / own["tokens_per_s"]
  if a is None or "dp" not in modes:
    return ratios
  b = modes["dp"]
  if a.get("tokens_per_s") and b.get("tokens_per_s"):
    ratios["tokens_per_s_decoupled_over_dp"] = a["tokens_per_s"] / b["tokens_per_s"]
  if a.get("final_eval_loss") and b.get("final_eval_loss"):
    ratios["final_eval_loss_decoupled_over_dp"] = a["final_eval_loss"] / b["final_eval_loss"]
  # The last evaluation of a step wins: the final one (after the flush) over the periodic one.
  ours, theirs = dict(a.get("evals", [])), dict(b.get("evals", []))
  ratios["eval_loss_at_equal_tokens"] = [[step, ours[step], theirs[step]]
                                         for step in sorted(ours) if step in theirs]
  return ratios


def write(report: dict, out: str) -> None:
  os.makedirs(os.path.dirname(out), exist_ok=True)
  with open(out + ".json", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  gb = lambda b: f"{b / 1e9:.2f}" if b else "-"  # noqa: E731
  num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
  device = report["device"]
  lines = [f"{device['kind']} ({device['platform']}), experiments/one_gpu.py:{report['size']}, "
           f"{report['steps']} steps, {report['date']}. `{report['command']}`", "",
           "| mode | status | final eval | tokens/s | tokens/s/device | MFU | first step s "
           "(process start / build start) | "
           "device peak GB (planned) | build s | merges / due | goodput | late offers | "
           "buckets s (useful / discarded / idle) | steps dropped per apply |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  repeats = len({r["repeat"] for r in report["runs"]})
  for r in report["runs"]:
    mode = r["mode"] + (f" ({r['repeat']})" if repeats > 1 else "")
    if r["status"] == "skipped":
      lines.append(f"| {mode} | skipped: {r['why']} | | | | | | | | | | | | |")
      continue
    merges = f"{r['merges_before_flush']} / {r['merges_due']}" if r.get("merges_due") else "-"
    mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    status = r["status"] if r["status"] == "done" else (
        f"{r['status']} at steps {r.get('steps_reached')}")
    lines.append(
        f"| {mode} | {status} | {num(r.get('final_eval_loss'), '.4f')} | "
        f"{num(r.get('tokens_per_s'), ',.0f')} | {num(r.get('tokens_per_s_per_device'), ',.0f')} "
        f"| {mfu} | {num(r['process_to_first_step_s'], '.1f')} / "
        f"{num(r.get('first_step_s'), '.1f')} | {gb(r.get('device_peak_bytes'))} "
        f"({gb(r['planned_device_bytes'])}) | {num(r.get('build_seconds'), '.1f')} | {merges} | "
        f"{num(r.get('goodput'), '.3f')} | {num(r.get('late_offers'), 'd')} | "
        + (" / ".join(f"{r['buckets_s'][k]:.1f}" for k in ("useful", "discarded", "idle"))
           if r.get("buckets_s") else "-")
        + f" | {num(r.get('steps_dropped_per_apply'), '.2f')} |")
  lines.append("")
  for r in report["runs"]:
    if r.get("median_sync_s") is not None:
      mode = r["mode"] + (f" ({r['repeat']})" if repeats > 1 else "")
      lines.append(
          f"- {mode} rounds, medians: copy {r['median_copy_s']:.4f} s, grace window "
          f"{r['median_grace_window_s']:.4f} s, queue {r['median_queue_s']:.4f} s, sync "
          f"{r['median_sync_s']:.4f} s; {r['learners_per_merge']:.2f} learners per merge; "
          f"{r.get('stale_answers', 0)} stale answers, {r.get('due_while_in_flight', 0)} "
          f"fragments due while in flight")
  for repeat, comparison in enumerate(report["comparison"]):
    prefix = f"repeat {repeat}: " if repeats > 1 else ""
    for key, value in comparison.items():
      if key == "eval_loss_at_equal_tokens":
        lines.append(f"- {prefix}eval loss at equal tokens (step: decoupled / dp): " + ", ".join(
            f"{step}: {a:.4f} / {b:.4f}" for step, a, b in value))
      else:
        lines.append(f"- {prefix}{key}: {value:.4f}")
  with open(out + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  main()
