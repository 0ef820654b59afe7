r"""Draws a run from its metrics.jsonl: learner losses, global eval loss, merges and faults.

  .venv/bin/python scripts/plot_run.py WORKDIR [--out=WORKDIR/run.png]

Two panels share the y axis: against seconds since the run started, and against tokens trained by
all learners together (each learner's latest logged step x its tokens per step). Learner losses
are thin lines, the global model's held-out loss is the thick one, merges are ticks at the bottom
(one per fragment merge), and each fault, restart, rejoin, syncer restart and heartbeat absence is a
vertical line named in the legend. Needs matplotlib (`pip install -e .[bench]`).
"""

import collections
import json
import os
import sys

from absl import flags

from decoupled_diloco import errors

_OUT = flags.DEFINE_string("out", None, "Where the PNG goes; default WORKDIR/run.png.")

# metrics.jsonl kinds drawn as vertical marks, and their colours.
_MARKS = {"fault": "tab:red", "rejoin": "tab:green", "job_restart": "tab:orange",
          "syncer_restart": "tab:purple", "absent": "tab:gray", "back": "tab:olive"}


def read_run(workdir: str) -> dict:
  """The records of WORKDIR/metrics.jsonl by kind, and the run's tokens per learner step."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} does not exist: is {workdir} a run's config.workdir?")
  records = collections.defaultdict(list)
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # a line cut short by a crash
      records[record.get("kind")].append(record)
  if not records["learner"]:
    raise ValueError(f"{path} has no learner record yet: nothing to draw")
  return records


def _tokens_per_step(workdir: str) -> float | None:
  """Tokens of one learner step, from summary.json (tokens trained / steps made)."""
  try:
    with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
    return summary["tokens_trained"] / sum(summary["learner_steps"])
  except (OSError, KeyError, ValueError, ZeroDivisionError):
    return None  # a run still going, or one that died: the clock panel alone


def tokens_at(learner_records: list[dict], tokens_per_step: float):
  """time_s -> tokens trained by then, as (times, tokens) of each learner record, in time order."""
  latest, times, tokens = {}, [], []
  for record in sorted(learner_records, key=lambda r: r["time_s"]):
    latest[record["learner"]] = record["step"]
    times.append(record["time_s"])
    tokens.append(sum(latest.values()) * tokens_per_step)
  return times, tokens


def draw(workdir: str, out: str) -> None:
  records = read_run(workdir)
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  per_step = _tokens_per_step(workdir)
  clock_t, clock_tokens = tokens_at(records["learner"], per_step or 1.0)

  def to_tokens(times):
    return np.interp(times, clock_t, clock_tokens)

  panels = [("seconds since start", lambda t: np.asarray(t, float))]
  if per_step is not None:
    panels.append(("tokens trained (all learners)", to_tokens))
  fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.5), sharey=True,
                           squeeze=False)
  by_learner = collections.defaultdict(list)
  for record in records["learner"]:
    by_learner[record["learner"]].append(record)
  evals = sorted(records["eval"], key=lambda r: r["time_s"])
  for ax, (label, x) in zip(axes[0], panels):
    for m, rows in sorted(by_learner.items()):
      rows.sort(key=lambda r: r["time_s"])
      ax.plot(x([r["time_s"] for r in rows]), [r["loss"] for r in rows], linewidth=0.8,
              alpha=0.7, label=f"learner {m} train loss")
    if evals:
      ax.plot(x([r["time_s"] for r in evals]), [r["eval_loss"] for r in evals], "k-o",
              linewidth=2, markersize=4, label="global model, held-out loss")
    if records["merge"]:
      ax.plot(x([r["time_s"] for r in records["merge"]]), [0.0] * len(records["merge"]), "|",
              color="tab:blue", markersize=8, transform=ax.get_xaxis_transform(),
              label=f"merges ({len(records['merge'])})")
    for kind, colour in _MARKS.items():
      for i, record in enumerate(records[kind]):
        ax.axvline(float(x([record["time_s"]])[0]), color=colour, alpha=0.6, linewidth=1,
                   label=f"{kind} ({len(records[kind])})" if i == 0 else None)
    ax.set_xlabel(label)
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("loss (nats/token)")
  axes[0][-1].legend(fontsize=7, loc="upper right")
  fig.suptitle(os.path.abspath(workdir), fontsize=9)
  fig.tight_layout()
  fig.savefig(out, dpi=110)
  plt.close(fig)


def main(argv):
  if len(argv) != 2:
    raise errors.InputError(f"plot_run.py takes one WORKDIR, a run's config.workdir, not "
                            f"{argv[1:] or 'none'} (usage: plot_run.py WORKDIR [--out=PNG])")
  workdir = argv[1]
  out = _OUT.value or os.path.join(workdir, "run.png")
  try:
    draw(workdir, out)
  except ModuleNotFoundError as err:
    sys.exit(f"plot_run.py needs matplotlib ({err}): pip install -e '.[bench]'")
  except (FileNotFoundError, ValueError) as err:
    raise errors.InputError(f"WORKDIR={workdir}: {err}") from err
  print(out)


if __name__ == "__main__":
  errors.run_main(main)
