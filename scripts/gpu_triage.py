r"""Triage on a lent GPU within one time budget (issue 44, item 2): what CPU figures cannot tell.

  python scripts/gpu_triage.py                  # on a GPU: four phases, within 9 minutes
  python scripts/gpu_triage.py --dry_run        # the same phases at toy size on fake CPU devices

Phases, each run a process of its own (scripts/gpu_phases.py), all on experiments/one_gpu.py's
124M model with XLA's attention unless said otherwise:
  a. identity, deterministic: one learner of batch 16, with
     XLA_FLAGS=--xla_gpu_deterministic_ops=true: dp twice (settles whether dp is bit-identical
     run to run: the final eval losses equal to the bit) and decoupled with the identity outer
     step twice (scripts/bench_accelerator.py's IDENTITY), every step's training loss logged.
     Settles whether, with the noise gone, the identity run equals dp within 0.1% (H100 with
     cuDNN: +0.93% and +2.55%; H200 with XLA: -0.30%, then +0.07% and +0.26% before the merge
     and the rebase were made exact for one learner) and at which step, if any, its training
     losses leave dp's (on CPU none does: the identity run makes dp's steps bit for bit). A step
     apart is where to bisect from (donation off, publication ordered after the step).
  b. identity with cuDNN attention, not deterministic: dp twice and the identity step once;
     passes when the identity run is within dp's own spread (|dp1 - dp2|, at least 0.1%).
  c. four learners sharing the GPU (one_gpu.py's layout, batch 8 each) against dp (one job of
     batch 32): tokens/s over dp's (target >= 0.95), goodput (>= 0.85), late offers, merges.
  d. cuDNN attention with sharing learners, which the run refuses (settings.py): tried once in a
     process of its own with settings.CUDNN_SHARING_TRIAL_ENV set, evaluating every 10 steps
     (the crash came at the first evaluation). Records whether it crashed and its log's tail.

--budget_s (default 480 s; a stopped run's 15 s to end and the report's writing stay within 9
minutes) bounds the whole script: each run gets its weight's share of what is left; a run past its
share is stopped and reported from its metrics so far, and a run left under 5 s is skipped. The report is results/gpu_triage_<card>_<date>.{json,md} ('cpu' for a
dry run), rewritten after every run, so a killed script leaves its figures. In a dry run phase b
is skipped (cuDNN has no CPU kernel) and phase d fails at validation for the same reason: it
checks the plumbing, not the GPU. This process never imports JAX.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# None imports JAX.
import bench_accelerator  # pylint: disable=g-import-not-at-top,wrong-import-position
import bench_one_device  # pylint: disable=g-import-not-at-top,wrong-import-position
import framework_runs  # pylint: disable=g-import-not-at-top,wrong-import-position
import gpu_phases  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
DETERMINISTIC = "--xla_gpu_deterministic_ops=true"
IDENTITY_TOLERANCE = 1e-3  # the identity run's final eval loss over dp's, either way
TARGETS = {"tokens_per_s_over_dp": 0.95, "goodput": 0.85}
# The settings refusal's variable; settings.py itself imports JAX, so its name is repeated here
# (tests/test_gpu_scripts.py checks the two agree).
CUDNN_SHARING_TRIAL_ENV = "DECOUPLED_DILOCO_TRIAL_CUDNN_SHARING"
# Steps and evaluation of each phase, on a GPU and in a dry run. One learner's batch is the four
# sharing learners' together, so phases a, b and c train the same tokens per step.
STEPS = {"gpu": {"one": 100, "shared": 100, "trial": 30},
         "cpu": {"one": 6, "shared": 8, "trial": 4}}
BATCH = {"gpu": {"one": 16, "shared": 8}, "cpu": {"one": 8, "shared": 2}}


def plan(device: gpu_phases.Device) -> list[dict]:
  """Every run of the four phases, in order: phase, name, overrides, environment, weight."""
  size = "cpu" if device.dry_run else "gpu"
  steps, batch = STEPS[size], BATCH[size]
  one = device.overrides(num_learners=1, devices__learners_sharing_devices=1,
                         data__batch_size=batch["one"], num_steps=steps["one"], eval_every=0)
  shared = device.overrides(data__batch_size=batch["shared"], num_steps=steps["shared"],
                            eval_every=max(steps["shared"] // 2, 1))
  identity = {**bench_accelerator.IDENTITY, "mode": "decoupled"}
  deterministic = device.env(DETERMINISTIC)
  every_step = {"log_every": 1}  # phase a compares the training losses step by step
  runs = [{"phase": "a", "name": f"dp_deterministic_{i}",
           "overrides": {**one, **every_step, "mode": "dp"}, "env": deterministic,
           "weight": 1.0} for i in (1, 2)]
  runs += [{"phase": "a", "name": f"identity_deterministic_{i}",
            "overrides": {**one, **every_step, **identity}, "env": deterministic,
            "weight": 1.0} for i in (1, 2)]
  cudnn = {"model.attention": "cudnn"}
  runs += [{"phase": "b", "name": f"dp_cudnn_{i}", "overrides": {**one, **cudnn, "mode": "dp"},
            "env": device.env(), "weight": 0.9} for i in (1, 2)]
  runs.append({"phase": "b", "name": "identity_cudnn", "overrides": {**one, **cudnn, **identity},
               "env": device.env(), "weight": 0.9})
  runs += [{"phase": "c", "name": f"{mode}_shared", "overrides": {**shared, "mode": mode},
            "env": device.env(), "weight": weight}
           for mode, weight in (("dp", 1.2), ("decoupled", 1.5))]
  trial = {**shared, **cudnn, "model.dtype": "bfloat16", "mode": "decoupled",
           "num_steps": steps["trial"],
           "eval_every": max(steps["trial"] // 3, 1)}
  runs.append({"phase": "d", "name": "decoupled_shared_cudnn", "overrides": trial,
               "env": device.env(**{CUDNN_SHARING_TRIAL_ENV: "1"}), "weight": 0.8})
  if device.dry_run:  # no cuDNN kernel on a CPU: phase b would only fail at validation
    for r in runs:
      if r["phase"] == "b":
        r["skip"] = "cuDNN attention has no CPU kernel (dry run)"
  return runs


def _final(runs: dict, name: str) -> float | None:
  return runs.get(name, {}).get("final_eval_loss")


def _mean(values: list[float | None]) -> float | None:
  known = [v for v in values if v is not None]
  return sum(known) / len(known) if known and len(known) == len(values) else None


def first_step_apart(losses: dict | None, reference: dict | None) -> int | None:
  """The first step whose training loss differs from the reference's (both {step: loss}); 0 when
  every step both have is equal, None when either is missing."""
  if not losses or not reference:
    return None
  return framework_runs.first_step_differing(losses, reference) or 0


def judge(phase: str, runs: dict) -> dict:
  """A phase's verdict from its runs' figures (`runs` by name); None where a figure is missing."""
  if phase == "a":
    dp = [_final(runs, f"dp_deterministic_{i}") for i in (1, 2)]
    ident = [_final(runs, f"identity_deterministic_{i}") for i in (1, 2)]
    gap = gpu_phases.relative_gap(_mean(ident), _mean(dp))
    reference = runs.get("dp_deterministic_1", {}).get("step_losses")
    # Where an identity run leaves dp's steps: 0 = every training loss equal to dp's, bit for bit
    # (as on CPU); else the step to bisect from.
    apart = {f"identity_{i}_first_step_apart_from_dp": first_step_apart(
        runs.get(f"identity_deterministic_{i}", {}).get("step_losses"), reference)
             for i in (1, 2)}
    return {"dp_bit_identical": None if None in dp else dp[0] == dp[1],
            "dp_steps_apart": first_step_apart(
                runs.get("dp_deterministic_2", {}).get("step_losses"), reference),
            "identity_bit_identical": None if None in ident else ident[0] == ident[1],
            **apart,
            "identity_gap_to_dp": gap,
            "identity_within_0.1%": None if gap is None else abs(gap) <= IDENTITY_TOLERANCE}
  if phase == "b":
    dp = [_final(runs, f"dp_cudnn_{i}") for i in (1, 2)]
    mean = _mean(dp)
    spread = None if mean is None else abs(dp[0] - dp[1]) / mean
    gap = gpu_phases.relative_gap(_final(runs, "identity_cudnn"), mean)
    within = None if gap is None or spread is None else abs(gap) <= max(spread,
                                                                        IDENTITY_TOLERANCE)
    return {"dp_spread": spread, "identity_gap_to_dp": gap, "identity_within_dp_spread": within}
  if phase == "c":
    dp, ours = runs.get("dp_shared", {}), runs.get("decoupled_shared", {})
    ratios = bench_one_device.compare({"decoupled": ours, "dp": dp})
    over = ratios.get("tokens_per_s_decoupled_over_dp")
    goodput = ours.get("goodput")
    return {"tokens_per_s_over_dp": over,
            "final_eval_loss_over_dp": ratios.get("final_eval_loss_decoupled_over_dp"),
            "goodput": goodput, "late_offers": ours.get("late_offers"),
            "merges_before_flush": ours.get("merges_before_flush"),
            "merges_due": ours.get("merges_due"),
            # Where the learners' idle seconds went: the end after the last step (the flush of
            # it) against the run's wall time, decoupled and dp (a short run feels a fixed end).
            "buckets_s": ours.get("buckets_s"),
            "end_seconds": ours.get("end_seconds"), "flush_seconds": ours.get("flush_seconds"),
            "wall_seconds": ours.get("wall_seconds"), "dp_end_seconds": dp.get("end_seconds"),
            "eval_loss_at_equal_tokens": ratios.get("eval_loss_at_equal_tokens", []),
            "tokens_per_s_target_met": None if over is None else
            over >= TARGETS["tokens_per_s_over_dp"],
            "goodput_target_met": None if goodput is None else goodput >= TARGETS["goodput"]}
  trial = runs.get("decoupled_shared_cudnn", {})
  status, tail = trial.get("status"), trial.get("log_tail", "")
  # A config the run refuses fails before it places anything: no crash, a refusal (a dry run's).
  refused = status == "failed" and "Invalid config" in tail
  return {"status": status, "refused_at_validation": refused,
          "crashed": None if status in (None, "skipped") else status == "failed" and not refused,
          "evals_reached": len(trial.get("evals", [])), "steps_reached": trial.get("steps_reached"),
          "error_tail": tail[-1500:] if status == "failed" else ""}


_TITLES = {"a": "identity, deterministic (XLA attention)", "b": "identity with cuDNN attention",
           "c": "four learners sharing the GPU against dp", "d": "cuDNN with sharing learners"}


def render(report: dict) -> list[str]:
  kind = report["device"]["kind"]
  lines = [f"# GPU triage, {report['date']}: {kind}" + (" (dry run)" if report["dry_run"] else ""),
           "", f"`{report['command']}` ({report['seconds']:.0f} s of a {report['budget_s']:.0f} s "
           "budget)", "",
           "| phase | run | status | final eval | tokens/s | goodput | late offers | merges / due "
           "| limit s |", "|---|---|---|---|---|---|---|---|---|"]
  for phase, entry in report["phases"].items():
    for r in entry["runs"]:
      merges = f"{r['merges_before_flush']} / {r['merges_due']}" if r.get("merges_due") else "-"
      status = r["status"] + (f": {r['why']}" if r.get("why") else "") + (
          f" at steps {r['steps_reached']}" if r.get("steps_reached") else "")
      lines.append(f"| {phase} | {r['name']} | {status} | "
                   f"{gpu_phases.fmt(r.get('final_eval_loss'))} | "
                   f"{gpu_phases.fmt(r.get('tokens_per_s'), ',.0f')} | "
                   f"{gpu_phases.fmt(r.get('goodput'), '.3f')} | {r.get('late_offers', '-')} | "
                   f"{merges} | {r.get('timeout_s', '-')} |")
  lines.append("")
  for phase, entry in report["phases"].items():
    verdict = entry["verdict"]
    shown = []
    for key, value in verdict.items():
      if key in ("eval_loss_at_equal_tokens", "error_tail"):
        continue
      if isinstance(value, float) and ("gap" in key or "spread" in key):
        shown.append(f"{key} {gpu_phases.percent(value)}")
      elif isinstance(value, float):
        shown.append(f"{key} {value:.4f}")
      else:
        shown.append(f"{key} {value}")
    lines.append(f"- **{phase}. {_TITLES[phase]}**: " + ", ".join(shown))
    if verdict.get("error_tail"):
      tail = verdict["error_tail"].strip().splitlines()[-6:]
      lines += ["", "  ```", *(f"  {line[:200]}" for line in tail), "  ```"]
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--budget_s", type=float, default=480.0, help="the whole script, seconds")
  parser.add_argument("--dry_run", action="store_true",
                      help="the same phases at toy size on fake CPU devices, in seconds")
  parser.add_argument("--phases", default="a,b,c,d", help="a subset of a,b,c,d, comma-separated")
  parser.add_argument("--workdir", default="/tmp/gpu_triage", help="the runs' working directories")
  parser.add_argument("--out_dir", default=str(ROOT / "results"), help="where the report goes")
  args = parser.parse_args()
  phases = args.phases.split(",")
  unknown = sorted(set(phases) - set(_TITLES))
  if unknown:
    parser.error(f"--phases={args.phases}: {','.join(unknown)} not among a,b,c,d")
  budget = gpu_phases.Budget(args.budget_s)
  device = gpu_phases.Device(args.dry_run)
  report = gpu_phases.Report("gpu_triage", device, args.out_dir,
                             "python scripts/gpu_triage.py " + " ".join(sys.argv[1:]), render)
  report.data["budget_s"] = args.budget_s
  runs = [r for r in plan(device) if r["phase"] in phases]
  done: dict[str, dict] = {}
  for i, r in enumerate(runs):
    entry = report.data["phases"].setdefault(r["phase"], {"runs": [], "verdict": {}})
    if r.get("skip"):
      figures = {"name": r["name"], "status": "skipped", "why": r["skip"]}
    else:
      after = sum(later["weight"] for later in runs[i + 1:] if not later.get("skip"))
      figures = gpu_phases.run(device, budget, r["name"], r["overrides"], workdir=args.workdir,
                               weight=r["weight"], weight_after=after, env=r["env"])
      if r["phase"] == "a":
        figures["step_losses"] = framework_runs.step_losses(
            os.path.join(args.workdir, r["name"]), learner=0)
    done[r["name"]] = figures
    entry["runs"].append(figures)
    entry["verdict"] = judge(r["phase"], done)
    report.write(budget)
  print(open(report.prefix + ".md", encoding="utf-8").read())


if __name__ == "__main__":
  main()
