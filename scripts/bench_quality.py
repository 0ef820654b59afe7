r"""Final eval loss of dp vs decoupled (M = 4) vs diloco at equal tokens on the bundled corpus.

Every mode runs experiments/tiny_cpu.py (same model, data, seed, token budget: dp steps on
num_learners x batch_size sequences). The figure is decoupled's final eval loss relative to dp's,
measured in the same run. Target: decoupled within 1% of dp, every mode well below the
bigram level (2.45 nats per byte).

  python scripts/bench_quality.py                        # 3 modes x 800 steps
  python scripts/bench_quality.py --modes=dp,decoupled --num_steps=400 --config.sync.period=12
"""

import json
import os
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import flags
from ml_collections import config_flags

from decoupled_diloco import errors
from decoupled_diloco.runtime.core import devices  # pylint: disable=g-import-not-at-top

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "tiny_cpu.py"),
    "Base experiment; its mode is overridden per run.")
# Runs: a mode, or a named variant = a mode plus overrides. "decoupled_h8" syncs each of 8 fragments
# every 8 steps, keeps the steps a learner made while its offer was being merged, and uses plain
# SGD (lr 1) as outer optimizer: the best decoupled setting found at 200 steps (its figure at 800:
# docs/benchmarks.md, "Quality at equal tokens").
VARIANTS = {
    "decoupled_h8": ("decoupled", {"sync.num_fragments": 8, "sync.period": 8,
                                   "merge.keep_in_flight_progress": True,
                                   "outer.learning_rate": 1.0, "outer.momentum": 0.0}),
}
_MODES = flags.DEFINE_list("modes", ["dp", "decoupled", "decoupled_h8", "diloco"],
                           f"Modes or variants ({', '.join(VARIANTS)}) to compare.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 800, "Inner steps per learner (dp: its steps).")
_OUT = flags.DEFINE_string("out", "results/bench_quality", "Writes OUT.json and OUT.md.")


def main(argv):
  del argv
  base = _CONFIG.value
  devices.request_fake_cpu_devices(base.devices.num_fake_cpu_devices)
  from decoupled_diloco import settings
  from decoupled_diloco.lm import data  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime import train
  data_settings = settings.validate(base).data
  if data_settings.tokenizer != "byte":
    raise ValueError(f"config.data.tokenizer={data_settings.tokenizer!r}: the unigram and bigram "
                     f"baselines here are byte-level; compare other tokenizers in bits per byte")
  train_tokens, eval_tokens = data.split_tokens(data.load_tokens(data_settings.source),
                                                data_settings.eval_fraction)
  bigram = data.bigram_entropy(train_tokens, eval_tokens)
  unigram = data.unigram_entropy(eval_tokens)
  results = {}
  start = time.perf_counter()
  for mode in _MODES.value:
    config = base.copy_and_resolve_references()
    config.mode, overrides = VARIANTS.get(mode, (mode, {}))
    config.update_from_flattened_dict(overrides)
    config.num_steps = _NUM_STEPS.value
    config.eval_every = 0
    config.workdir = f"/tmp/bench_quality/{mode}"
    summary = train.train_and_evaluate(settings.validate(config))
    results[mode] = {k: summary[k] for k in (
        "final_eval_loss", "tokens_trained", "wall_seconds", "merges", "learner_steps",
        "bytes_learner_syncer")}
    results[mode]["overrides"] = overrides
    print(f"{mode:10s} final eval loss {summary['final_eval_loss']:.4f} nats/token, "
          f"{summary['tokens_trained']:,} tokens, {summary['wall_seconds']:.0f} s", flush=True)
  seconds = time.perf_counter() - start
  report = {"num_steps": _NUM_STEPS.value, "modes": results, "bigram_eval": bigram,
            "unigram_eval": unigram, "seconds": seconds,
            "machine": f"{os.cpu_count()} CPU cores", "target_rel_gap": 0.01}
  if "dp" in results and "decoupled" in results:
    dp, dec = results["dp"]["final_eval_loss"], results["decoupled"]["final_eval_loss"]
    report["decoupled_over_dp"] = dec / dp
    print(f"decoupled / dp = {dec / dp:.4f} ({100 * (dec / dp - 1):+.2f}%; target within 1%)")
    for name in VARIANTS:
      if name in results:
        report[f"{name}_over_dp"] = results[name]["final_eval_loss"] / dp
  lines = ["| mode | final eval loss (nats/token) | vs dp | tokens | wall s |", "|---|---|---|---|---|"]
  for mode, r in results.items():
    rel = (f"{100 * (r['final_eval_loss'] / results['dp']['final_eval_loss'] - 1):+.2f}%"
           if "dp" in results else "")
    lines.append(f"| {mode} | {r['final_eval_loss']:.4f} | {rel} | {r['tokens_trained']:,} | "
                 f"{r['wall_seconds']:.0f} |")
  lines.append(f"\nReference levels on the held-out split: bigram {bigram:.3f}, unigram {unigram:.3f}."
               f" {_NUM_STEPS.value} steps per mode; whole benchmark {seconds / 60:.1f} min on "
               f"{os.cpu_count()} CPU cores.")
  os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
  with open(_OUT.value + ".json", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  with open(_OUT.value + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines))


if __name__ == "__main__":
  errors.run_main(main)
