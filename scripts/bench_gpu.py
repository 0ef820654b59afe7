r"""The accelerator figures in one command, within one time budget: for a GPU lent for minutes.

  python scripts/bench_gpu.py --budget_s=540

runs, one after the other, each run in processes of its own that share one compilation cache:
  1. scripts/bench_accelerator.py --size=200m: one learner at 201.6M parameters in dp mode, with
     the identity outer step (its final eval loss must track dp's) and a plain JAX step of the same
     shape: tokens/s against it, MFU, first-step time, host peak RSS, merges due vs done with
     config.syncer.num_workers set for this host's cores;
  2. scripts/bench_one_device.py: experiments/one_gpu.py's four learners sharing the one device
     against dp on it at equal tokens: final eval loss, tokens/s, first step, device memory;
then writes both reports, the device's name and the library versions to
results/accelerator_gpu_<card>_<date>.{json,md}, <card> from the device's kind ('h100'; each
part's own files go beside them). A part that runs
out of its share of the budget is stopped and reported from what it logged. This process never
imports JAX (it would take the GPU's memory from the runs) and reaches nothing over the network.
"""

import argparse
import datetime
import json
import os
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
_VERSIONS = ("import json, importlib.metadata as m; print(json.dumps({p: m.version(p) for p in "
             "('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'grain', 'numpy')}))")


def card_name(device_kind: str) -> str:
  """A short name for file names: 'h100' for 'NVIDIA H100 80GB HBM3', else the kind's words
  joined ('tpu_v5_lite'), so that two cards' reports of one day do not overwrite each other."""
  model = re.search(r"\b([A-Z]\d{2,4}[A-Za-z]?)\b", device_kind)
  words = re.findall(r"[a-z0-9]+", device_kind.lower())
  return model.group(1).lower() if model else "_".join(words) or "unknown"


def _device_kind() -> str:
  """The first device's kind, from a short process of its own (this one never imports JAX)."""
  probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.devices()[0].device_kind)"],
                         capture_output=True, text=True, check=False, timeout=300)
  return probe.stdout.strip().splitlines()[-1] if probe.returncode == 0 and probe.stdout else ""


def _run(args: list[str], budget_s: float) -> int:
  print("$ " + " ".join(args), flush=True)
  try:
    return subprocess.run([sys.executable, *args], cwd=ROOT, timeout=budget_s + 60).returncode
  except subprocess.TimeoutExpired:
    return -1


def _load(prefix: str) -> dict | None:
  try:
    with open(prefix + ".json", encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--budget_s", type=float, default=540.0, help="both parts together")
  parser.add_argument("--share", type=float, default=0.55, help="of the budget for part 1")
  parser.add_argument("--accelerator_steps", type=int, default=240)
  parser.add_argument("--one_device_steps", type=int, default=150)
  parser.add_argument("--accelerator_size", default="200m",
                      help="bench_accelerator's --size (small: a dry run of this script on CPU)")
  parser.add_argument("--one_device_size", default=None,
                      help="bench_one_device's --size (default: gpu on a GPU; cpu for a dry run)")
  parser.add_argument("--attention", default=None,
                      help="bench_accelerator's --attention (config.model.attention: xla, cudnn)")
  parser.add_argument("--out_dir", default=str(ROOT / "results"))
  args = parser.parse_args()
  started = time.perf_counter()
  date = datetime.date.today().isoformat()
  versions = json.loads(subprocess.run([sys.executable, "-c", _VERSIONS], capture_output=True,
                                       text=True, check=True).stdout)
  cache = "/tmp/bench_gpu_jax_cache"
  workers = max(1, min(8, (os.cpu_count() or 2) // 2))
  stem = f"accelerator_gpu_{card_name(_device_kind())}_{date}"  # e.g. accelerator_gpu_h100_<date>
  accelerator = os.path.join(args.out_dir, f"{stem}_{args.accelerator_size}")
  _run(["scripts/bench_accelerator.py", f"--size={args.accelerator_size}", f"--steps={args.accelerator_steps}",
        "--runs=dp,decoupled_identity,reference", f"--budget_s={args.budget_s * args.share:.0f}",
        *([f"--attention={args.attention}"] if args.attention else []),
        f"--set=syncer.num_workers={workers}", f"--set=compilation_cache_dir={cache}",
        f"--out={accelerator}"], args.budget_s * args.share)
  left = args.budget_s - (time.perf_counter() - started)
  one_device = os.path.join(args.out_dir, f"{stem}_one_device")
  size = [f"--size={args.one_device_size}"] if args.one_device_size else []
  _run(["scripts/bench_one_device.py", *size, f"--steps={args.one_device_steps}", f"--budget_s={left:.0f}",
        f"--set=syncer.num_workers={workers}", f"--set=compilation_cache_dir={cache}",
        f"--out={one_device}"], left)
  parts = {"one_learner_200m": _load(accelerator), "four_learners_one_device": _load(one_device)}
  device = next((p["device"] for p in parts.values() if p), None)
  report = {"date": date, "device": device, "versions": versions, "host_cpus": os.cpu_count(),
            "seconds": time.perf_counter() - started, "command": " ".join(sys.argv), **parts}
  out = os.path.join(args.out_dir, stem)
  with open(out + ".json", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  lines = [f"# Accelerator figures, {date}: {device['kind'] if device else 'no device found'}", "",
           f"`{report['command']}` ({report['seconds']:.0f} s; host CPUs {os.cpu_count()}; "
           + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")", ""]
  for title, prefix in ((f"One learner, size {args.accelerator_size}", accelerator),
                        ("Four learners sharing the one device against dp", one_device)):
    lines += [f"## {title}", ""]
    try:
      with open(prefix + ".md", encoding="utf-8") as f:
        lines.append(f.read())
    except FileNotFoundError:
      lines.append("(no result: the part did not start or failed before its first run)\n")
  with open(out + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  print("\n".join(lines))


if __name__ == "__main__":
  main()
