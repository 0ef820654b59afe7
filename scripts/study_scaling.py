r"""Quality across model size (docs/studies.md): does decoupled's eval-loss gap to dp shrink with
the number of parameters as DiLoCo's does, and does asynchrony cost anything?

Published: DiLoCo, M = 4 (Charles et al. 2025, arXiv 2503.09799, Table 4), +2.0% at 35M, +1.1% at
180M, +0.3% at 2.4B parameters, M = 1 0.1-0.4% below dp, the gap shrinking about as N^-0.35 from
35M to 335M; Streaming DiLoCo (arXiv 2501.18512), M = 4, H = 30: +2.6% at 35M, +1.1% at 500M;
asynchronous Local-SGD (arXiv 2401.09135): asynchrony alone costs about 1%.

Arms at every size: dp (one learner on the 8 devices, a batch of M x 16 sequences), decoupled
M = 1 (one learner, the same batch), decoupled M = 4 and lock-step streaming M = 4 (the same M,
H, P, tau: only the asynchrony differs). At the largest size, decoupled M = 4 with each option of
OPTIONS as well; an option whose config field does not exist is skipped and the report says so.
Every size trains the same tokens per parameter, 20 by default (Chinchilla's ratio, which the
DiLoCo scaling study trained at too); the batch is fixed, so the steps grow with the size, and the
smallest size makes few merges (xs: 83 steps, each fragment merged about 3 times at H = 24). The
default study (xs, s, m: 34k, 123k and 279k parameters) was estimated at 2.7 h on 2 shared cores
with the keep-in-flight option alone (~1 h more for the other two), m seeing 5.5 epochs of the
corpus. `--num_steps` > 0 sets every size's steps instead (smoke runs). Every mode its own inner
learning rate (`--tune`: a sweep at the smallest size, chosen on a validation split carved from
the training text; else INNER_LR, what study_quality found). Every run holds the same validation
split out, so all train on the same text.

  python scripts/study_scaling.py --plan              # the plan and its time, no training
  python scripts/study_scaling.py --calibrate --plan  # time a short run per size first
  python scripts/study_scaling.py --tune              # sweep the inner rates, then the study
  python scripts/study_scaling.py --sizes=tiny --num_steps=30 --seeds=0   # smoke

Each run is a separate training command (scripts/study_common.py), kept under $STUDY_ROOT and read
back when present: a stopped study resumes where it stopped.
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
import types
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags

from decoupled_diloco import errors
from decoupled_diloco.lm import flops as flops_lib

import study_common as sc  # pylint: disable=g-import-not-at-top

# Model shapes (config.model.*), about 3x apart in parameters; "tiny" is for smoke runs, m is
# tiny_cpu's model. Three blocks or more: the paper's P = 24 fragments (tiny_cpu's, every size)
# need 24 parameter tensors, and a block holds 9. 1m (~1.1M) is offered, not run by default: at
# the same tokens per parameter it costs ~15x m on two cores.
SIZES = {
    "tiny": {"model.embed_dim": 16, "model.num_layers": 3, "model.num_heads": 2,
             "model.head_dim": 8, "model.mlp_dim": 32},
    "xs": {"model.embed_dim": 24, "model.num_layers": 3, "model.num_heads": 2,
           "model.head_dim": 12, "model.mlp_dim": 96},
    "s": {"model.embed_dim": 48, "model.num_layers": 3, "model.num_heads": 3,
          "model.head_dim": 16, "model.mlp_dim": 192},
    "m": {"model.embed_dim": 64, "model.num_layers": 4, "model.num_heads": 4,
          "model.head_dim": 16, "model.mlp_dim": 256},
    "1m": {"model.embed_dim": 128, "model.num_layers": 4, "model.num_heads": 4,
           "model.head_dim": 32, "model.mlp_dim": 512},
}
M = 4  # learners of the multi-learner arms
BATCH = 16  # sequences per learner per step (dp and M = 1: M x this on one learner)
SEQ_LEN = 128
DEVICES = 8  # learner devices of tiny_cpu (4 x 2), every arm trains on all of them
TOKENS_PER_STEP = M * BATCH * SEQ_LEN  # every arm, every size
# The inner learning rates without --tune: study_quality's best for dp and for decoupled (both
# 2e-2, the largest it tried), taken for the other arms too.
INNER_LR = {"dp": 2e-2, "decoupled M=1": 2e-2, "decoupled M=4": 2e-2, "streaming M=4": 2e-2}
TUNE_LRS = (5e-3, 1e-2, 2e-2, 3e-2)
# Every run: tiny_cpu's outer momentum now (study_common's STUDY_SETTINGS pins the older 0.6), a
# validation split to tune on, one evaluation at the end.
COMMON = {"outer.momentum": 0.3, "data.validation_fraction": 0.05, "data.batch_size": BATCH,
          "data.seq_len": SEQ_LEN, "eval_every": 0, "eval_batches": 16}
ARMS = {
    "dp": {"mode": "dp"},
    "decoupled M=1": {"mode": "decoupled", "num_learners": 1, "data.batch_size": M * BATCH,
                      "learner_mesh_shapes": ((DEVICES, 1),)},
    "decoupled M=4": {"mode": "decoupled"},
    "streaming M=4": {"mode": "streaming"},
}
# Decoupled M = 4 at the largest size with one more setting each (the paper's overwrite on
# receive is the decoupled M=4 arm itself).
OPTIONS = {
    "decoupled M=4, nesterov_delay=4": {"outer.nesterov_delay": 4},
    "decoupled M=4, staleness inverse_sqrt": {"outer.staleness_scaling": "inverse_sqrt"},
    "decoupled M=4, keep in-flight progress": {"merge.keep_in_flight_progress": True},
}
# Published gaps to dp, percent of eval loss, by parameters.
PUBLISHED = {
    "DiLoCo M=4 (2503.09799 Table 4)": {35e6: 2.0, 180e6: 1.1, 2.4e9: 0.3},
    "Streaming DiLoCo M=4 H=30 (2501.18512)": {35e6: 2.6, 500e6: 1.1},
}
PUBLISHED_EXPONENT = 0.35  # DiLoCo M=4, 35M-335M (2503.09799)
PUBLISHED_ASYNC_COST = 1.0  # percent, asynchronous Local-SGD (2401.09135)
CORPUS_BYTES = 1_115_394  # the bundled tiny-shakespeare, byte tokens
EVAL_FRACTION = 0.05  # tiny_cpu's data.eval_fraction
CALIBRATION_STEPS = 30
# Without calibration runs, seconds per step from model FLOPs at this rate: decoupled M = 4 at
# tiny_cpu's size made 800 steps in 962 s on 2 cores (results/bench_quality.md), ~14 GFLOP/s.
FALLBACK_FLOPS_PER_S = 14e9
# Each arm's seconds per step relative to decoupled M = 4 on 2 cores (bench_quality: dp 543 s,
# decoupled 962 s, lock-step diloco 1079 s for the same 800 steps); M = 1 taken as dp.
ARM_COST = {"dp": 0.56, "decoupled M=1": 0.56, "decoupled M=4": 1.0, "streaming M=4": 1.12}
STARTUP_S = 60.0  # per run without calibration: start-up and compiles (tiny: 58 s)


def num_params(size: Mapping[str, Any]) -> int:
  """Parameters of a byte-level model of this shape, as the runtime builds it."""
  from decoupled_diloco.lm import model as model_lib  # pylint: disable=g-import-not-at-top
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top
  fields = dict(tiny_cpu.get_config().model)
  fields.update({k.split(".", 1)[1]: v for k, v in size.items()})
  fields["vocab_size"] = fields["vocab_size"] or 256
  return model_lib.num_params(model_lib.param_shapes(model_lib.ModelConfig(**fields)))


def flops_per_step(size: Mapping[str, Any]) -> float:
  shape = types.SimpleNamespace(vocab_size=256, remat="none",
                                **{k.split(".", 1)[1]: v for k, v in size.items()})
  return flops_lib.model_flops_per_token(shape, SEQ_LEN) * TOKENS_PER_STEP


def _corpus_bytes() -> int:
  """Bytes (byte tokens) of the study's corpus: --data_source's file, else the bundled one."""
  return os.path.getsize(_DATA_SOURCE.value) if _DATA_SOURCE.value else CORPUS_BYTES


def common() -> dict[str, Any]:
  """COMMON, with --data_source when one is given."""
  source = {"data.source": os.path.abspath(_DATA_SOURCE.value)} if _DATA_SOURCE.value else {}
  return {**COMMON, **source}


def train_tokens(corpus_bytes: int = CORPUS_BYTES) -> int:
  """Tokens a run trains on: the corpus less the eval tail and the validation split."""
  return int(corpus_bytes * (1 - EVAL_FRACTION) * (1 - COMMON["data.validation_fraction"]))


def steps_for(params: int, tokens_per_param: float) -> int:
  return max(1, round(tokens_per_param * params / TOKENS_PER_STEP))


def plan(sizes: Sequence[str], tokens_per_param: float, *, num_steps: int | None = None,
         params: Mapping[str, int] | None = None, corpus_bytes: int = CORPUS_BYTES
         ) -> list[dict[str, Any]]:
  """One row per size: parameters, steps, tokens, tokens per parameter, epochs of the corpus.
  `num_steps` overrides the steps of every size (smoke runs: the tokens per parameter differ)."""
  rows = []
  for name in sizes:
    n = params[name] if params else num_params(SIZES[name])
    steps = num_steps or steps_for(n, tokens_per_param)
    tokens = steps * TOKENS_PER_STEP
    rows.append({"size": name, "params": n, "steps": steps, "tokens": tokens,
                 "tokens_per_param": tokens / n, "epochs": tokens / train_tokens(corpus_bytes)})
  return rows


def field_exists(config, dotted: str) -> bool:
  node = config
  for part in dotted.split("."):
    if part not in node:
      return False
    node = node[part]
  return True


def option_arms(config) -> tuple[dict[str, dict[str, Any]], list[str]]:
  """The OPTIONS whose fields `config` has, and a message for each one skipped."""
  kept, skipped = {}, []
  for name, overrides in OPTIONS.items():
    missing = [f for f in overrides if not field_exists(config, f)]
    if missing:
      skipped.append(f"{name}: skipped, config.{missing[0]} does not exist in this tree")
    else:
      kept[name] = overrides
  return kept, skipped


def fit_exponent(params: Sequence[float], gaps: Sequence[float]) -> dict[str, Any]:
  """gap = A N^-alpha by least squares on log gap against log N: alpha, its 95% interval
  (Student's t with n - 2 degrees of freedom), A. Undefined unless every gap is > 0 and the
  points span two sizes or more."""
  from scipy import stats  # pylint: disable=g-import-not-at-top
  if any(g <= 0 for g in gaps):
    return {"exponent": None, "why": "a gap is <= 0: no power law fits", "n": len(gaps)}
  if len(set(params)) < 2:
    return {"exponent": None, "why": "one size only", "n": len(gaps)}
  x = [math.log(p) for p in params]
  y = [math.log(g) for g in gaps]
  n = len(x)
  mx, my = sum(x) / n, sum(y) / n
  sxx = sum((a - mx) ** 2 for a in x)
  slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sxx
  intercept = my - slope * mx
  out = {"exponent": -slope, "prefactor": math.exp(intercept), "n": n, "low": None,
         "high": None}
  if n > 2:
    resid = sum((b - intercept - slope * a) ** 2 for a, b in zip(x, y))
    half = stats.t.ppf(0.975, n - 2) * math.sqrt(resid / (n - 2) / sxx)
    out.update(low=-slope - half, high=-slope + half)
  return out


# ----------------------------------------------------------------------------------------------
# The command.

_SIZES = flags.DEFINE_list("sizes", ["xs", "s", "m"], f"Model sizes, of {list(SIZES)}.")
_TOKENS_PER_PARAM = flags.DEFINE_float("tokens_per_param", 20.0,
                                       "Tokens every size trains per parameter.")
_NUM_STEPS, _SEEDS, _FRESH = sc.study_flags(num_steps=0)
_PLAN = flags.DEFINE_bool("plan", False, "Print the plan and its time estimate; train nothing "
                          "(but --calibrate's runs).")
_CALIBRATE = flags.DEFINE_bool("calibrate", False, f"Time a {CALIBRATION_STEPS}-step decoupled "
                               "run per size for the estimate (kept, as every run).")
_TUNE = flags.DEFINE_bool("tune", False, f"Sweep each arm's inner learning rate over {TUNE_LRS} "
                          "at the smallest size (seed: the first), chosen on validation.")
_OPTIONS = flags.DEFINE_bool("options", True, "Run the option arms at the largest size.")
_DATA_SOURCE = flags.DEFINE_string(
    "data_source", "", "One text file as the corpus (default: the bundled tiny-shakespeare), e.g. "
    "prepare_code_corpus.py --text_out's; reported as results/study_scaling_<its name>.")


def _size_overrides(row) -> dict[str, Any]:
  return {**SIZES[row["size"]], "num_steps": row["steps"]}


def figures(workdir, summary):
  del workdir
  return {"final_eval_loss": summary["final_eval_loss"],
          "validation_loss": summary["final_validation_loss"],
          "tokens": summary["tokens_trained"], "num_params": summary["num_params"],
          "wall_seconds": summary["wall_seconds"], "train_seconds": summary["train_seconds"],
          # start-up (build and compiles) and the learners' mean seconds per step, for --plan
          "startup_seconds": summary["build_seconds"] + summary["wall_seconds"]
                             - summary["train_seconds"],
          "step_seconds": len(summary["learner_steps_per_s"])
                          / sum(summary["learner_steps_per_s"])}


def calibration(rows, seed: int, *, run: bool) -> dict[str, dict[str, float]]:
  """{size: seconds per step of decoupled M = 4, start-up seconds} from short runs; without
  `run`, from the ones already made only."""
  out = {}
  read_only = os.environ.get("STUDY_READ_ONLY")
  if not run:
    os.environ["STUDY_READ_ONLY"] = "1"  # run_study fails where a run is missing
  try:
    for row in rows:
      arm = sc.Arm(f"{row['size']} calibration", {**SIZES[row["size"]], **ARMS["decoupled M=4"],
                                                  "num_steps": CALIBRATION_STEPS})
      try:
        result = sc.run_study("scaling", [arm], [seed], base=common(), fresh=False,
                              figures=figures)[arm.name][seed]
      except RuntimeError:
        if run:
          raise
        continue
      out[row["size"]] = {"step_s": result["step_seconds"], "startup_s": result["startup_seconds"]}
  finally:
    if read_only is None:
      os.environ.pop("STUDY_READ_ONLY", None)
  return out


def estimate(rows, arms: Sequence[str], options: Sequence[str], seeds: int,
             calib: Mapping[str, Mapping[str, float]], *, tuning: bool = False
             ) -> tuple[float, list[str]]:
  """Seconds the study takes (with the tuning sweep: one seed of every arm at every rate of
  TUNE_LRS at the smallest size), and how each size's step time was had."""
  total, how = 0.0, []
  for i, row in enumerate(rows):
    if row["size"] in calib:
      step_s, startup = calib[row["size"]]["step_s"], calib[row["size"]]["startup_s"]
      how.append(f"{row['size']}: {step_s:.3f} s/step measured")
    else:
      step_s, startup = flops_per_step(SIZES[row["size"]]) / FALLBACK_FLOPS_PER_S, STARTUP_S
      how.append(f"{row['size']}: {step_s:.3f} s/step from FLOPs (no calibration run)")
    names = list(arms) + (list(options) if i == len(rows) - 1 else [])
    for name in names:
      total += seeds * (startup + row["steps"] * step_s * ARM_COST.get(name, 1.0))
      if tuning and i == 0 and name in arms:
        total += len(TUNE_LRS) * (startup + row["steps"] * step_s * ARM_COST[name])
  return total, how


def _plan_table(rows) -> str:
  return sc.markdown_table(
      ["size", "parameters", "steps", "tokens", "tokens/param", "epochs of the corpus"],
      [[r["size"], f"{r['params']:,}", r["steps"], f"{r['tokens']:,}",
        f"{r['tokens_per_param']:.2f}", f"{r['epochs']:.2f}"] for r in rows])


def tune(rows, seed: int) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """Each arm's inner rate with the lowest validation loss at the smallest size."""
  smallest = rows[0]
  arms = [sc.Arm(f"tune {smallest['size']} {name} lr={lr:g}",
                 {**_size_overrides(smallest), **overrides, "inner.learning_rate": lr})
          for name, overrides in ARMS.items() for lr in TUNE_LRS]
  runs = sc.run_study("scaling", arms, [seed], base=common(), fresh=_FRESH.value, figures=figures)
  tried, best = [], {}
  for name in ARMS:
    scores = {lr: runs[f"tune {smallest['size']} {name} lr={lr:g}"][seed]["validation_loss"]
              for lr in TUNE_LRS}
    best[name] = min(scores, key=scores.get)
    tried += [{"arm": name, "inner_lr": lr, "validation_loss": v} for lr, v in scores.items()]
  return best, tried


def main(argv):
  del argv
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top
  seeds = [int(s) for s in _SEEDS.value]
  rows = plan(_SIZES.value, _TOKENS_PER_PARAM.value, num_steps=_NUM_STEPS.value or None,
              corpus_bytes=_corpus_bytes())
  options, skipped = option_arms(tiny_cpu.get_config()) if _OPTIONS.value else ({}, [])
  for message in skipped:
    print(message, flush=True)
  calib = calibration(rows, seeds[0], run=_CALIBRATE.value)
  seconds, how = estimate(rows, list(ARMS), list(options), len(seeds), calib,
                          tuning=_TUNE.value)
  plan_table = _plan_table(rows)
  print(plan_table)
  print(f"{len(seeds)} seed(s); arms {list(ARMS)} at every size, {list(options)} at "
        f"{rows[-1]['size']}; {TOKENS_PER_STEP:,} tokens per step; the corpus trains "
        f"{train_tokens(_corpus_bytes()):,} tokens per epoch.\n" + "\n".join(how) +
        f"\nestimate: {seconds / 3600:.1f} h on {os.cpu_count()} CPU cores"
        + (" with the tuning sweep" if _TUNE.value else ""), flush=True)
  if _PLAN.value:
    return
  lrs, tried = (tune(rows, seeds[0]) if _TUNE.value else (dict(INNER_LR), []))
  arms = []
  for i, row in enumerate(rows):
    names = {**ARMS, **({name: {**ARMS["decoupled M=4"], **extra} for name, extra in
                         options.items()} if i == len(rows) - 1 else {})}
    for name, overrides in names.items():
      lr = lrs[name if name in ARMS else "decoupled M=4"]
      arms.append(sc.Arm(f"{row['size']} {name}",
                         {**_size_overrides(row), **overrides, "inner.learning_rate": lr}))
  runs = sc.run_study("scaling", arms, seeds, base=common(), fresh=_FRESH.value, figures=figures)
  report, markdown = _report(rows, runs, seeds, lrs, tried, skipped, options, seconds)
  report["step_times"] = how
  name = "scaling" + (f"_{pathlib.Path(_DATA_SOURCE.value).stem}" if _DATA_SOURCE.value else "")
  stem = sc.write(name, report, markdown)
  _plot(stem, report)


def gaps(runs, rows, arm: str) -> list[tuple[int, int, float]]:
  """(size's parameters, seed, percent gap to dp on that seed) of `arm` at every size."""
  out = []
  for row in rows:
    by_seed, dp = runs.get(f"{row['size']} {arm}", {}), runs[f"{row['size']} dp"]
    out += [(row["params"], s, 100 * (by_seed[s]["final_eval_loss"] / dp[s]["final_eval_loss"]
                                      - 1)) for s in sorted(set(by_seed) & set(dp))]
  return out


def _report(rows, runs, seeds, lrs, tried, skipped, options, seconds):
  stats = sc.summarize(runs, ["final_eval_loss", "validation_loss"])

  def loss_table(metric: str) -> str:
    header = ["size", "parameters"] + [f"{a} (vs dp)" if a != "dp" else a for a in ARMS]
    table = []
    for row in rows:
      dp = stats[f"{row['size']} dp"][metric]["mean"]
      cells = []
      for arm in ARMS:
        loss = stats[f"{row['size']} {arm}"][metric]
        cells.append(f"{sc.fmt(loss)} ({100 * (loss['mean'] / dp - 1):+.2f}%)"
                     if arm != "dp" else sc.fmt(loss))
      table.append([row["size"], f"{row['params']:,}"] + cells)
    return sc.markdown_table(header, table)

  async_rows = []
  for row in rows:
    dec, stream = (f"{row['size']} decoupled M=4", f"{row['size']} streaming M=4")
    cost = 100 * (stats[dec]["final_eval_loss"]["mean"] / stats[stream]["final_eval_loss"]
                  ["mean"] - 1)
    async_rows.append([row["size"], f"{cost:+.2f}%", sc.paired(runs, dec, stream),
                       f"~{PUBLISHED_ASYNC_COST:+.1f}%"])
  fits = {}
  for arm in ("decoupled M=4", "streaming M=4", "decoupled M=1"):
    points = gaps(runs, rows, arm)
    fits[arm] = {"points": points, **fit_exponent([p for p, _, _ in points],
                                                  [g for _, _, g in points])}
  published = {name: fit_exponent(list(by_n), list(by_n.values()))
               for name, by_n in PUBLISHED.items()}
  fit_rows = [[arm, _fmt_fit(f)] for arm, f in fits.items()]
  fit_rows += [[f"published: {name}", f"{_fmt_fit(f)}; gaps " + ", ".join(
      f"{g:+.1f}% at {_n(n)}" for n, g in PUBLISHED[name].items())]
      for name, f in published.items()]
  fit_rows.append(["published: DiLoCo M=4, 35M-335M, stated", f"~{PUBLISHED_EXPONENT}"])
  option_rows = []
  last = rows[-1]["size"]
  for name in options:
    arm = f"{last} {name}"
    loss = stats[arm]["final_eval_loss"]
    dp = stats[f"{last} dp"]["final_eval_loss"]["mean"]
    option_rows.append([name, sc.fmt(loss), f"{100 * (loss['mean'] / dp - 1):+.2f}%",
                        sc.paired(runs, arm, f"{last} decoupled M=4")])
  async_table = sc.markdown_table(
      ["size", "decoupled vs streaming", "minus streaming, per seed", "published"], async_rows)
  markdown = (
      f"# Study: the gap to dp across model size\n\n`python scripts/study_scaling.py "
      f"--sizes={','.join(r['size'] for r in rows)} --tokens_per_param="
      f"{_TOKENS_PER_PARAM.value:g} --seeds={','.join(map(str, seeds))}"
      f"{f' --num_steps={_NUM_STEPS.value}' if _NUM_STEPS.value else ''}"
      f"{f' --data_source={_DATA_SOURCE.value}' if _DATA_SOURCE.value else ''}"
      f"{' --tune' if tried else ''}`; {TOKENS_PER_STEP:,} tokens per step for every arm, "
      f"inner learning rates {lrs}; estimated {seconds / 3600:.1f} h.\n\n{_plan_table(rows)}\n\n"
      f"## Final eval loss (nats/token), mean (min-max) over seeds, and the gap to dp\n\n"
      f"On the eval tail (the last 5% of the text), which every gap below uses.\n\n"
      f"{loss_table('final_eval_loss')}\n\n"
      f"## Validation loss, the same models\n\n"
      f"On the validation split (the 5% of the training text before the eval tail, held out "
      f"from training too): a second held-out text, to see how far the gaps depend on it.\n\n"
      f"{loss_table('validation_loss')}\n\n"
      f"## Asynchrony: decoupled M=4 against lock-step streaming M=4 (same M, H, P)\n\n"
      f"{async_table}\n\n"
      f"## The gap's exponent: gap = A N^-alpha, least squares on log gap (per seed), 95% "
      f"interval\n\n{sc.markdown_table(['arm', 'alpha'], fit_rows)}\n")
  if option_rows or skipped:
    markdown += (f"\n## Options at {last}, decoupled M=4\n\n" + (sc.markdown_table(
        ["arm", "eval loss", "vs dp", "minus decoupled M=4, per seed"], option_rows)
        if option_rows else "") + "\n" + "".join(f"\n- {s}" for s in skipped) + "\n")
  if tried:
    markdown += "\n## Inner learning rate sweep at the smallest size (validation loss)\n\n" + \
        sc.markdown_table(["arm", "inner lr", "validation loss"],
                          [[t["arm"], f"{t['inner_lr']:g}", f"{t['validation_loss']:.4f}"]
                           for t in tried]) + "\n"
    edge = [arm for arm, lr in lrs.items() if lr in (min(TUNE_LRS), max(TUNE_LRS))]
    if edge:
      markdown += f"\nAt the edge of the grid (the best may lie beyond it): {', '.join(edge)}.\n"
  print(markdown)
  report = {"plan": rows, "seeds": seeds, "tokens_per_param": _TOKENS_PER_PARAM.value,
            "data_source": _DATA_SOURCE.value or "the bundled tiny-shakespeare",
            "tokens_per_step": TOKENS_PER_STEP, "inner_lr": lrs, "tune": tried,
            "skipped": skipped, "fits": fits, "published": {
                "gaps": {k: {str(n): g for n, g in v.items()} for k, v in PUBLISHED.items()},
                "fits": published, "stated_exponent": PUBLISHED_EXPONENT,
                "async_cost_percent": PUBLISHED_ASYNC_COST},
            "stats": stats, "runs": runs, "estimate_s": seconds}
  return report, markdown


def _n(n: float) -> str:
  return f"{n / 1e9:g}B" if n >= 1e9 else f"{n / 1e6:g}M"


def _fmt_fit(fit) -> str:
  if fit["exponent"] is None:
    return f"none ({fit['why']})"
  if fit["low"] is None:
    return f"{fit['exponent']:.2f} (two points: no interval)"
  return f"{fit['exponent']:.2f} ({fit['low']:.2f} to {fit['high']:.2f}), {fit['n']} points"


def _plot(stem, report):
  plt = sc.pyplot()
  fig, (losses, gap_ax) = plt.subplots(1, 2, figsize=(10, 4))
  rows, stats = report["plan"], report["stats"]
  params = [r["params"] for r in rows]
  for arm in ARMS:
    losses.plot(params, [stats[f"{r['size']} {arm}"]["final_eval_loss"]["mean"] for r in rows],
                marker="o", label=arm)
  losses.set(xscale="log", xlabel="parameters", ylabel="final eval loss (nats/token)",
             title="this framework, tiny-shakespeare")
  losses.legend()
  colours = {arm: f"C{i}" for i, arm in enumerate(ARMS)}  # as in the left panel
  for arm, fit in report["fits"].items():
    points = [(p, g) for p, _, g in fit["points"] if g > 0]
    if points:
      gap_ax.scatter(*zip(*points), color=colours[arm], label=f"{arm} (ours)")
    if fit["exponent"] is not None:
      ends = [min(params), max(params)]
      gap_ax.plot(ends, [fit["prefactor"] * n ** -fit["exponent"] for n in ends],
                  color=colours[arm], lw=1)
  for i, (name, by_n) in enumerate(PUBLISHED.items()):
    gap_ax.plot(list(by_n), list(by_n.values()), marker="s", ls="--", color=f"C{i + 5}",
                label=name)
  gap_ax.set(xscale="log", yscale="log", xlabel="parameters", ylabel="gap to dp (%)",
             title="eval-loss gap to dp")
  gap_ax.legend(fontsize=7)
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
