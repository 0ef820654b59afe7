r"""Quality gap to dp (docs/studies.md): the gap between decoupled and dp at equal tokens, and how
far honest tuning closes it.

Tuning reads only a validation split carved from the training text
(`data.validation_fraction=0.05`, the same for every run, dp included); the eval split is read once
per configuration, after the choice, to report it. Both modes get tuning budgets of their own:

  1. tune, `--tune_steps` (200) steps, seed 0: dp's inner learning rate over LRS; decoupled by
     coordinate descent from the defaults, one knob at a time in KNOBS' order (outer learning
     rate, outer momentum, H and P, the inner learning rate, keeping in-flight progress, the
     outlier test of the robust merge), each knob set to its best value on validation before
     the next is tried. Every configuration tried is reported.
  2. confirm, `--confirm_steps` (800) steps, seeds 0 and 1: dp and decoupled at their defaults and
     at their tuned settings; the gap is read on the eval split.

Each run is a separate training command (scripts/study_common.py); a stopped study resumes where
it stopped. Stage 1 is about 21 runs (~45 min on 2 cores), stage 2 8 runs of 800 steps
(~60-70 min): this study is the long one.

  python scripts/study_quality.py                    # both stages
  python scripts/study_quality.py --stage=tune
  python scripts/study_quality.py --previous=results/study_quality.json   # new arms only

`--previous` reads the tuning and the confirmed runs back from an earlier results file and runs
only what it lacks (the report names what was read back, and when it was made).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import flags

from decoupled_diloco import errors

import study_common as sc  # pylint: disable=g-import-not-at-top

_STAGE = flags.DEFINE_enum("stage", "all", ["tune", "confirm", "all"], "What to run.")
_TUNE_STEPS = flags.DEFINE_integer("tune_steps", 200, "Steps of every tuning run.")
_CONFIRM_STEPS = flags.DEFINE_integer("confirm_steps", 800, "Steps of every confirming run.")
_, _SEEDS, _FRESH = sc.study_flags(num_steps=None, seeds_help="Seeds of the confirming runs.")

VALIDATION = {"data.validation_fraction": 0.05, "eval_every": 0, "eval_batches": 16}
# The inner learning rates both modes try (tiny_cpu: 3e-3). At 200 steps dp's best was the largest
# of 2e-3..8e-3, then of 2e-3..1.2e-2, so the grid goes on to 2e-2; decoupled tries the same grid.
LRS = (2e-3, 3e-3, 5e-3, 8e-3, 1.2e-2, 2e-2)
# Decoupled knobs in the order they are tuned; the first value of each is tiny_cpu's default.
KNOBS = (
    ("outer", ({}, {"outer.learning_rate": 0.5}, {"outer.learning_rate": 1.0},
               {"outer.name": "sgd", "outer.learning_rate": 1.0, "outer.momentum": 0.0})),
    ("momentum", ({}, {"outer.momentum": 0.3}, {"outer.momentum": 0.8})),
    ("H and P", ({}, {"sync.period": 12, "sync.num_fragments": 12},
                 {"sync.period": 48, "sync.num_fragments": 24})),
    ("inner lr", ({},) + tuple({"inner.learning_rate": lr} for lr in LRS if lr != 3e-3)),
    ("keep in-flight", ({}, {"merge.keep_in_flight_progress": True})),
    ("outlier test", ({}, {"merge.max_norm_ratio": 0.0})),
)


def figures(workdir, summary):
  del workdir
  return {"validation_loss": summary["final_validation_loss"],
          "final_eval_loss": summary["final_eval_loss"], "goodput": summary.get("goodput"),
          "wall_seconds": summary["wall_seconds"]}


def _name(overrides) -> str:
  return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "defaults"


def tune(seed: int):
  """(dp's best overrides, decoupled's best overrides, every configuration tried)."""
  base = {**VALIDATION, "num_steps": _TUNE_STEPS.value}
  tried = []

  def trial(mode, overrides):
    arm = sc.Arm(f"{mode}: {_name(overrides)}", {"mode": mode, **overrides})
    result = sc.run_study("quality", [arm], [seed], base=base, fresh=_FRESH.value,
                          figures=figures)[arm.name][seed]
    tried.append({"mode": mode, "knob": knob_name, "overrides": overrides, **result})
    return result["validation_loss"]

  knob_name = "inner lr (dp)"
  dp_scores = {lr: trial("dp", {"inner.learning_rate": lr}) for lr in LRS}
  dp_best = {"inner.learning_rate": min(dp_scores, key=dp_scores.get)}
  best: dict = {}
  for knob_name, values in KNOBS:
    scores = []
    for value in values:
      scores.append((trial("decoupled", {**best, **value}), value))
    best = {**best, **min(scores, key=lambda s: s[0])[1]}
  return dp_best, best, tried


def main(argv):
  del argv
  seeds = [int(s) for s in _SEEDS.value]
  report = {"tune_steps": _TUNE_STEPS.value, "confirm_steps": _CONFIRM_STEPS.value,
            "validation": VALIDATION}
  previous = sc.previous_report()
  if previous:  # the tuning as it was chosen then
    dp_best, dec_best, tried = (previous["dp_best"], previous["decoupled_best"],
                                previous["tried"])
    report["tuning_date"] = previous.get("tuning_date", previous["date"])
  else:
    dp_best, dec_best, tried = tune(seeds[0])
  report.update(dp_best=dp_best, decoupled_best=dec_best, tried=tried)
  rows = [[t["mode"], t["knob"], _name(t["overrides"]), f"{t['validation_loss']:.4f}",
           f"{t['final_eval_loss']:.4f}"] for t in tried]
  tune_table = sc.markdown_table(
      ["mode", "knob", "settings", "validation loss", "eval loss (not used to choose)"], rows)
  print(tune_table)
  markdown = (f"# Study: the quality gap to dp\n\n`python scripts/study_quality.py "
              f"--tune_steps={_TUNE_STEPS.value} --confirm_steps={_CONFIRM_STEPS.value} "
              f"--seeds={','.join(map(str, seeds))}`; every run holds out "
              f"data.validation_fraction=0.05 of the training text.\n\n"
              f"## 1. Tuning, {_TUNE_STEPS.value} steps, seed {seeds[0]}, chosen on validation\n\n"
              f"{tune_table}\n\ndp's best: {_name(dp_best)}; decoupled's best: "
              f"{_name(dec_best)}.\n")
  if previous:
    markdown += (f"\nThese tuning runs were read back from the results of "
                 f"{report['tuning_date']} (`--previous`).\n")
  if _STAGE.value != "tune":
    base = {**VALIDATION, "num_steps": _CONFIRM_STEPS.value}
    arms = [sc.Arm("dp, defaults", {"mode": "dp"}),
            sc.Arm("dp, tuned", {"mode": "dp", **dp_best}),
            sc.Arm("decoupled, defaults", {"mode": "decoupled"}),
            sc.Arm("decoupled, tuned", {"mode": "decoupled", **dec_best})]
    # H and P set how many bytes a learner moves per step (halving both doubles them), and their
    # tuning step won on validation by less than a seed's spread: the tuned settings with H and P
    # at their defaults, the candidate for tiny_cpu's defaults.
    wire = {k: v for k, v in dec_best.items() if k not in ("sync.period", "sync.num_fragments")}
    if wire != dec_best:
      arms.append(sc.Arm("decoupled, tuned, default H and P", {"mode": "decoupled", **wire}))
    runs = sc.run_study("quality", arms, seeds, base=base, fresh=_FRESH.value, figures=figures)
    stats = sc.summarize(runs, ["final_eval_loss", "validation_loss"])
    report.update(confirm_stats=stats, confirm_runs=runs)
    rows = []
    for arm in runs:
      dp = stats["dp, tuned" if "tuned" in arm else "dp, defaults"]["final_eval_loss"]["mean"]
      loss = stats[arm]["final_eval_loss"]
      rows.append([arm, sc.fmt(loss), f"{loss['mean'] / dp - 1:+.2%}",
                   sc.fmt(stats[arm]["validation_loss"]), f"{loss['spread']:.4f}"])
    confirm_table = sc.markdown_table(
        ["arm", "final eval loss (min-max)", "vs dp alike", "validation loss", "seed spread"],
        rows)
    print(confirm_table)
    markdown += (f"\n## 2. Confirmed, {_CONFIRM_STEPS.value} steps, seeds {seeds}\n\n"
                 f"{confirm_table}\n")
  stem = sc.write("quality", report, markdown)
  _plot(stem, tried)


def _plot(stem, tried):
  plt = sc.pyplot()
  fig, ax = plt.subplots(figsize=(9, 4))
  for i, t in enumerate(tried):
    ax.scatter(i, t["validation_loss"], color="C0" if t["mode"] == "dp" else "C1")
  ax.set(xticks=range(len(tried)), xlabel="configuration tried (in order; dp blue, decoupled "
         "orange)", ylabel="validation loss (nats/token)", title="tuning on validation")
  sc.save_figure(fig, stem)


if __name__ == "__main__":
  errors.run_main(main)
