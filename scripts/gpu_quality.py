r"""The first quality point where the published law speaks, on a lent GPU within one time budget
(issue 44, item 3): decoupled M = 4's eval-loss gap to dp at >= 20 tokens per parameter with no
token seen twice, beside DiLoCo's law and beside lock-step streaming M = 4.

  python scripts/gpu_quality.py                    # on a GPU: corpus, size, three arms, <= 9 min
  python scripts/gpu_quality.py --corpus_dir=DIR   # shards from scripts/prepare_code_corpus.py
  python scripts/gpu_quality.py --dry_run          # the same steps at toy size on fake CPU devices

Steps: (1) the corpus: scripts/prepare_code_corpus.py on this machine's site-packages, as many
bytes as the largest size the time allows would read (the report counts all there are; a few
seconds; --corpus_dir skips it, its seq_len must be SEQ_LEN); (2) the size: the largest of SIZES
whose 20 tokens per parameter fit both the corpus's training windows (no repetition: the learners'
disjoint shards together) and the decoupled arm's share of the budget at an *assumed* throughput,
--assumed_mfu (default 3.7%) of the card's dense bf16 peak over the model's FLOPs per token. That
is a fixed table and one measurement, not a calibration on the card at hand: 3.7% is what the
4.26M arms made on an H200 (results/gpu_quality_h200_2026-11-28.md; the 5% assumed there picked
the same size but left dp short of its last 150 steps); --size forces one. (3) three arms at equal tokens, each a process of its own
(scripts/gpu_phases.py), on experiments/one_gpu.py's layout: dp (one job of batch 4 x 32),
decoupled M = 4 and streaming M = 4 (config.mode=streaming: the same M, H = P = 24, tau, only the
asynchrony differs), all four learners sharing the GPU, with one_gpu.py's inner AdamW (lr 1e-3,
b2 0.95, weight decay 0.1) and tiny_cpu's outer step (Nesterov lr 0.7, momentum 0.3), not retuned
for the size. An arm past its share is stopped and compared at the last step every arm evaluated.

It settles: decoupled's gap to dp against 2.0% x (35M / N)^0.35 (DiLoCo M = 4, Charles et al.
2025, Table 4; +3.1% at 10M), the target being at most that; and decoupled within 0.5% of
streaming. --budget_s (default 510) bounds the whole script; a stopped run's 15 s to end and the
report's writing keep it within 9 minutes. The report, results/gpu_quality_<card>_<date>.{json,md}
('cpu' for a dry run), is rewritten after every step. This process never imports JAX.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# None imports JAX.
import bench_accelerator  # pylint: disable=g-import-not-at-top,wrong-import-position
import framework_runs  # pylint: disable=g-import-not-at-top,wrong-import-position
import gpu_phases  # pylint: disable=g-import-not-at-top,wrong-import-position

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ_LEN = {"gpu": 512, "cpu": 32}
# Sequences per learner per step (dp: M x this). 32 x 512 tokens: a step of a few-million-parameter
# model long enough that the per-step overhead (dispatch, offers, merges) does not rule it.
BATCH = {"gpu": 32, "cpu": 8}
M = 4
TOKENS_PER_PARAM = 20.0
LAW = {"gap_at_35m": 0.020, "exponent": 0.35}  # DiLoCo M = 4 (2503.09799, Table 4)
STREAMING_TOLERANCE = 0.005
# Byte-level decoders, heads of 64, MLP 4 x d; parameters from bench_accelerator.num_params.
SIZES = {name: {"model.embed_dim": d, "model.num_layers": layers, "model.num_heads": d // 64,
                "model.head_dim": 64, "model.mlp_dim": 4 * d}
         for name, d, layers in (("4m", 256, 4), ("6m", 256, 6), ("12m", 320, 7),
                                 ("19m", 384, 8), ("42m", 512, 10))}
TOY = {"toy": {"model.embed_dim": 16, "model.num_layers": 2, "model.num_heads": 2,
               "model.head_dim": 8, "model.mlp_dim": 32}}
DRY_RUN_STEPS = 8
# Arms: mode and weight (expected time, decoupled = 1). On the H200 at 4.26M dp's one job trained
# at 1.08x decoupled's tokens/s but, first to run, compiled into a cold cache (31.5 s to its first
# step against 20.5 s): with 0.8 of decoupled's share it stopped 150 steps short.
ARMS = {"dp": ("dp", 1.0), "decoupled M=4": ("decoupled", 1.0), "streaming M=4": ("streaming", 1.1)}
STARTUP_S = 40.0  # an arm's start-up and compiles on a GPU, outside its training time
SAFETY = 0.8  # of an arm's training time the plan may use


def law_gap(num_params: int) -> float:
  """DiLoCo M = 4's published gap to dp at `num_params`: 2.0% x (35M / N)^0.35."""
  return LAW["gap_at_35m"] * (35e6 / num_params) ** LAW["exponent"]


def with_seq(size: dict, seq_len: int) -> dict:
  return {**size, "model.max_seq_len": seq_len, "data.seq_len": seq_len}


def choose_size(sizes: dict, *, seq_len: int, batch: int, train_windows: int,
                train_seconds: float, flops_per_s: float | None) -> dict:
  """The largest size whose TOKENS_PER_PARAM tokens fit the corpus without repetition and, at
  `flops_per_s`, `train_seconds` x SAFETY; the smallest, marked, when none fits."""
  tokens_per_step = M * batch * seq_len
  max_steps = train_windows // (M * batch)  # every learner's shard read once at most
  rows = []
  for name, size in sizes.items():
    shape = with_seq(size, seq_len)
    params = bench_accelerator.num_params(shape)
    steps = math.ceil(TOKENS_PER_PARAM * params / tokens_per_step)
    seconds = (None if not flops_per_s else
               steps * tokens_per_step * bench_accelerator.flops_per_token(shape) / flops_per_s)
    fits = steps <= max_steps and (seconds is None or seconds <= SAFETY * train_seconds)
    rows.append({"size": name, "num_params": params, "steps": steps,
                 "tokens": steps * tokens_per_step, "estimated_train_s": seconds,
                 "fits": fits})
  fitting = [r for r in rows if r["fits"]]
  chosen = dict(max(fitting, key=lambda r: r["num_params"]) if fitting else rows[0])
  chosen["below_20_tokens_per_param"] = not fitting
  return {"chosen": chosen, "table": rows, "max_steps_without_repetition": max_steps}


def build_corpus(out_dir: str, seq_len: int, *, max_bytes: int, eval_fraction: float) -> dict:
  """scripts/prepare_code_corpus.py into `out_dir` (kept: a directory that holds one is read);
  its meta.json."""
  if not os.path.exists(os.path.join(out_dir, "meta.json")):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_code_corpus.py"),
                    f"--out_dir={out_dir}", f"--seq_len={seq_len}", f"--max_bytes={max_bytes}",
                    f"--eval_fraction={eval_fraction}"], cwd=ROOT, check=True, timeout=600)
  with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as f:
    return json.load(f)


def compare(arms: dict) -> dict:
  """Gaps at the last step every arm evaluated (the final evaluation when all finished)."""
  evals = {name: dict(map(tuple, r.get("evals", []))) for name, r in arms.items()}
  if len(evals) < len(ARMS) or not all(evals.values()):
    return {}
  common = set.intersection(*(set(e) for e in evals.values()))
  if not common:
    return {}
  step = max(common)
  loss = {name: e[step] for name, e in evals.items()}
  dp = loss["dp"]
  return {"step": step, "eval_loss": loss,
          "decoupled_gap_to_dp": loss["decoupled M=4"] / dp - 1,
          "streaming_gap_to_dp": loss["streaming M=4"] / dp - 1,
          "decoupled_over_streaming": loss["decoupled M=4"] / loss["streaming M=4"] - 1}


def render(report: dict) -> list[str]:
  lines = [f"# GPU quality point, {report['date']}: {report['device']['kind']}"
           + (" (dry run)" if report["dry_run"] else ""), "",
           f"`{report['command']}` ({report['seconds']:.0f} s of a {report['budget_s']:.0f} s "
           "budget)", ""]
  corpus = report["phases"].get("corpus")
  if corpus:
    c = corpus["code_corpus"]
    lines += [f"Corpus: {c['bytes']:,} bytes of Python from {c['files']:,} files, of "
              f"{c.get('available_bytes', c['bytes']):,} distinct bytes on this machine "
              f"({c['duplicate_files']:,} duplicate files), {corpus['train_windows']:,} "
              f"training windows of {corpus['seq_len']} tokens; fingerprint "
              f"`{c['fingerprint'][:16]}`", ""]
  size = report["phases"].get("size")
  if size:
    chosen = size["chosen"]
    lines += [f"Size: {chosen['size']}, {chosen['num_params'] / 1e6:.2f}M parameters, "
              f"{chosen['steps']:,} steps = {chosen['tokens']:,} tokens "
              f"({chosen['tokens'] / chosen['num_params']:.1f} per parameter"
              + (", below 20: nothing larger fits" if chosen["below_20_tokens_per_param"] else "")
              + f"); {size['how']}", ""]
  arms = report["phases"].get("arms", {})
  if arms:
    lines += ["| arm | status | final eval | tokens/s | goodput | merges / due | limit s |",
              "|---|---|---|---|---|---|---|"]
    for name, r in arms.items():
      merges = f"{r['merges_before_flush']} / {r['merges_due']}" if r.get("merges_due") else "-"
      status = r["status"] + (f" at steps {r['steps_reached']}" if r.get("steps_reached") else "")
      lines.append(f"| {name} | {status} | {gpu_phases.fmt(r.get('final_eval_loss'))} | "
                   f"{gpu_phases.fmt(r.get('tokens_per_s'), ',.0f')} | "
                   f"{gpu_phases.fmt(r.get('goodput'), '.3f')} | {merges} | "
                   f"{r.get('timeout_s', '-')} |")
    lines.append("")
  verdict = report["phases"].get("verdict")
  if verdict:
    lines += [f"- compared at step {verdict['step']}: decoupled M=4 "
              f"{gpu_phases.percent(verdict['decoupled_gap_to_dp'])} vs dp, law "
              f"{gpu_phases.percent(verdict['law_gap'])} at this size "
              f"(within: {verdict['decoupled_within_law']}); streaming M=4 "
              f"{gpu_phases.percent(verdict['streaming_gap_to_dp'])} vs dp; decoupled over "
              f"streaming {gpu_phases.percent(verdict['decoupled_over_streaming'])} "
              f"(within 0.5%: {verdict['decoupled_within_0.5%_of_streaming']})"]
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--budget_s", type=float, default=510.0, help="the whole script, seconds")
  parser.add_argument("--dry_run", action="store_true",
                      help="the same steps at toy size on fake CPU devices, in seconds")
  parser.add_argument("--corpus_dir", default=None,
                      help="shards of scripts/prepare_code_corpus.py (default: build them here)")
  parser.add_argument("--size", default=None, choices=sorted(SIZES), help="skip the choice")
  parser.add_argument("--assumed_mfu", type=float, default=0.037,
                      help="the sharing learners' model FLOPs utilisation the size choice assumes")
  parser.add_argument("--workdir", default="/tmp/gpu_quality", help="the runs' working directories")
  parser.add_argument("--out_dir", default=str(ROOT / "results"), help="where the report goes")
  args = parser.parse_args()
  budget = gpu_phases.Budget(args.budget_s)
  device = gpu_phases.Device(args.dry_run)
  report = gpu_phases.Report("gpu_quality", device, args.out_dir,
                             "python scripts/gpu_quality.py " + " ".join(sys.argv[1:]), render)
  report.data["budget_s"] = args.budget_s
  phases = report.data["phases"]
  platform = "cpu" if args.dry_run else "gpu"
  seq_len, batch = SEQ_LEN[platform], BATCH[platform]

  weights = sum(w for _, w in ARMS.values())
  decoupled = ARMS["decoupled M=4"][1]
  peak = framework_runs.peak_flops(device.probe["kind"])
  sizes = TOY if args.dry_run else {args.size: SIZES[args.size]} if args.size else SIZES
  flops_per_s = None if args.dry_run or not peak else args.assumed_mfu * peak

  def choose(train_windows: int) -> tuple[dict, float]:
    seconds = budget.share(decoupled, weights - decoupled) - (0 if args.dry_run else STARTUP_S)
    return choose_size(sizes, seq_len=seq_len, batch=batch, train_windows=train_windows,
                       train_seconds=seconds, flops_per_s=flops_per_s), seconds

  # The corpus holds what the largest size the time allows can train, and no more: building
  # bytes no run reads would take from the runs' time (the script still counts all there are).
  if args.dry_run:
    max_bytes, eval_fraction = 400_000, 0.05
  else:
    wanted = choose(10**12)[0]["chosen"]["tokens"]
    max_bytes, eval_fraction = int(wanted * 1.05 / 0.99) + 4 * M * batch * (seq_len + 1), 0.01
  corpus_dir = args.corpus_dir or os.path.join(args.workdir, f"code_corpus_{seq_len}")
  meta = build_corpus(corpus_dir, seq_len, max_bytes=max_bytes, eval_fraction=eval_fraction)
  if meta["seq_len"] != seq_len:
    sys.exit(f"--corpus_dir={corpus_dir}: its seq_len is {meta['seq_len']}, this script's "
             f"{seq_len}: prepare it with --seq_len={seq_len}")
  phases["corpus"] = {"dir": corpus_dir, "seq_len": seq_len,
                      "train_windows": meta["train"]["sequences"],
                      "code_corpus": meta.get("code_corpus", {})}
  report.write(budget)

  choice, train_seconds = choose(meta["train"]["sequences"])
  if args.dry_run:
    how = "dry run: the toy size"
    choice["chosen"].update(steps=DRY_RUN_STEPS, tokens=DRY_RUN_STEPS * M * batch * seq_len)
  else:
    how = ("--size" if args.size else
           f"the largest fitting {train_seconds:.0f} s of training at an assumed "
           f"{100 * args.assumed_mfu:.0f}% MFU" + ("" if peak else " (card's peak unknown: "
                                                   "corpus bound only)"))
  chosen = choice["chosen"]
  phases["size"] = {**choice, "how": how, "assumed_mfu": args.assumed_mfu, "peak_flops": peak}
  report.write(budget)

  steps = chosen["steps"]
  overrides = device.overrides(
      **{k.replace(".", "__"): v for k, v in with_seq(sizes[chosen["size"]], seq_len).items()},
      data__source=os.path.abspath(corpus_dir), data__batch_size=batch, num_steps=steps,
      eval_every=max(steps // 4, 1), eval_batches=1 if args.dry_run else 8,
      inner__warmup_steps=max(1, min(200, steps // 10)), log_every=max(1, min(50, steps // 10)))
  phases["arms"] = {}
  names = list(ARMS)
  for i, name in enumerate(names):
    mode, weight = ARMS[name]
    after = sum(ARMS[n][1] for n in names[i + 1:])
    phases["arms"][name] = gpu_phases.run(
        device, budget, name.replace(" ", "_").replace("=", ""), {**overrides, "mode": mode},
        workdir=args.workdir, weight=weight, weight_after=after)
    verdict = compare(phases["arms"])
    if verdict:
      gap = law_gap(chosen["num_params"])
      verdict.update(law_gap=gap, decoupled_within_law=verdict["decoupled_gap_to_dp"] <= gap,
                     **{"decoupled_within_0.5%_of_streaming":
                        abs(verdict["decoupled_over_streaming"]) <= STREAMING_TOLERANCE})
      phases["verdict"] = verdict
    report.write(budget)
  print(open(report.prefix + ".md", encoding="utf-8").read())


if __name__ == "__main__":
  main()
