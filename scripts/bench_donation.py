"""The same run with and without donating the train state, one after the other.

  .venv/bin/python scripts/bench_donation.py [--config=experiments/tiny_cpu.py]

Runs the experiment twice as a user would (`python -m decoupled_diloco.main`), with
`--config.donate_state=never` and `=always`, and prints and writes `results/donation.json`: final
eval loss, goodput, late offers (pulls that had not landed when their round closed), discarded
progress and tokens/s per device of each, and the donating run's ratios to the other. On XLA:CPU
this is why `donate_state=auto` does not donate there; on GPU/TPU, run it to see what it costs.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

from absl import flags

from decoupled_diloco import errors

_CONFIG = flags.DEFINE_string("config", "experiments/tiny_cpu.py", "Experiment config file.")
_OUT = flags.DEFINE_string("out", "results/donation.json", "Where the figures go.")

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_KEYS = ("final_eval_loss", "goodput", "late_offers", "discarded_progress",
         "tokens_per_s_per_device", "merges", "wall_seconds", "device_kind")


def _run(workdir: str, donate: str) -> dict:
  subprocess.run([sys.executable, "-m", "decoupled_diloco.main", f"--config={_CONFIG.value}",
                  f"--config.workdir={workdir}", f"--config.donate_state={donate}"],
                 cwd=_ROOT, check=True)
  with open(os.path.join(workdir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  return {k: summary.get(k) for k in _KEYS}


def main(argv):
  del argv
  base = tempfile.mkdtemp(prefix="bench_donation_")
  runs = {donate: _run(os.path.join(base, donate), donate)
          for donate in ("never", "always")}
  kept, donated = runs["never"], runs["always"]
  result = {
      "config": _CONFIG.value, **runs,
      "ratio_tokens_per_s": donated["tokens_per_s_per_device"] / kept["tokens_per_s_per_device"],
      "ratio_goodput": donated["goodput"] / kept["goodput"],
      "ratio_final_eval_loss": donated["final_eval_loss"] / kept["final_eval_loss"],
  }
  os.makedirs(os.path.dirname(_ROOT / _OUT.value), exist_ok=True)
  with open(_ROOT / _OUT.value, "w", encoding="utf-8") as f:
    json.dump(result, f, indent=2)
  for name, run in runs.items():
    print(f"donate_state={name}: loss {run['final_eval_loss']:.4f}, goodput "
          f"{100 * run['goodput']:.1f}%, late offers {run['late_offers']}, tok/s/dev "
          f"{run['tokens_per_s_per_device']:,.0f}, discarded "
          f"{[round(d, 3) for d in run['discarded_progress']]}")
  print(f"always / never: tokens/s {result['ratio_tokens_per_s']:.3f}, goodput "
        f"{result['ratio_goodput']:.3f}, final eval loss {result['ratio_final_eval_loss']:.4f}")


if __name__ == "__main__":
  errors.run_main(main)
