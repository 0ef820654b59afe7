r"""The paper's headline on sockets: data parallelism against Decoupled DiLoCo over capped links.

  .venv/bin/python scripts/bench_sites.py                                  # 3 rates, ~17 min here
  .venv/bin/python scripts/bench_sites.py --rates_mbit=100 --num_steps=48 --out=/tmp/smoke

Three emulated sites on this machine (scripts/emulated_sites.py; needs root): two learner sites and
the syncer's, each link capped both ways at the rate, the Ray head and the command in the root
namespace. Every run is the training command (`python -m decoupled_diloco.main`, runtime=ray on
that cluster), the same model (experiments/tiny_cpu.py) and the same tokens per step:

- dp: one learner of two processes, one on each learner site (config.ray.processes_per_learner=2,
  mesh (2, 1), each process B rows): every step's gradient all-reduce crosses both links. The
  runtime has no dp mode under Ray, so it runs decoupled with the identity outer step (Theta_p =
  the learner's fragment; its eval is dp's, tests/test_ray_runtime.py) and each fragment synced
  once per run (sync.period = num_steps), which those bytes, to the syncer's site, show apart;
- decoupled: one learner per learner site, B rows each, the syncer on its own site, the paper's
  defaults (P = H = 24, tau = 2, bf16 outer gradients up) with Theta_p sent down in bf16
  (`DECOUPLED_WIRE`): with tiny_cpu's fp32 broadcast the syncer's own link was the busiest at
  10 Mbit/s (60.6 MB in 45.9 s of training, more than the link carries), its pulls queued behind
  the broadcasts and 141 of 180 merges' offers came late (7 at 1 Gbit/s), eval +4.5% against dp.

Per run: tokens/s over the training seconds; bytes on each link from the interfaces' counters and,
split by peer (the other learner site, the syncer's, the command's), from the links' htb class
counters, payload only (`emulated_sites.FRAME_OVERHEAD_BYTES` a frame off); summary.json's own
byte counts beside them; eval loss at equal tokens; and the bandwidth model's (sim/bandwidth.py)
prediction: its bytes for the same N, and its wall-clock for the same rate, from the paper's bytes
and from the bytes the counters saw. The model's compute step time t is calibrated once per mode,
on the run at the highest rate (the step time there less the model's link time), so that row
matches by construction and the others test it. The model's rate is the link's payload rate: the
cap counts every frame's headers (1448 of each 1514 bytes are payload at MTU 1500).

Checks (`checks`): at the lowest rate decoupled makes >= 5x dp's tokens/s with its eval loss no
further from dp's than at the highest rate; the model's wall-clock within 25% of the measured one;
the learner <-> syncer bytes the htb counters saw within 5% of summary.json's counts. A failed check
is printed and makes the exit status 1.

Writes OUT.json and OUT.md (`--out`, default results/bench_sites). Never imports JAX: the runs are
subprocesses (scripts/framework_runs.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import platform
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from absl import app  # pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags

import emulated_sites  # pylint: disable=wrong-import-position
import framework_runs  # pylint: disable=wrong-import-position
from decoupled_diloco.sim import bandwidth  # pylint: disable=wrong-import-position

_RATES = flags.DEFINE_list("rates_mbit", ["1000", "100", "10"], "Link rates, Mbit/s, highest first.")
_MODES = flags.DEFINE_list("modes", ["dp", "decoupled"], "Which arms to run at each rate.")
_NUM_STEPS = flags.DEFINE_integer("num_steps", 144, "Inner steps (a multiple of 24).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Rows of 128 tokens per learner process a step.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 1200.0, "Kill a run after this many seconds.")
_OUT = flags.DEFINE_string("out", "results/bench_sites", "Results path without extension.")
_BREAK = flags.DEFINE_bool(
    "break_whole_model", False, "Break it on purpose: decoupled learners offer the whole model "
    "every step (sync.num_fragments=1, sync.period=1), the model still expecting P = H = 24; the "
    "byte checks must fail.")

LEARNER_SITE, SYNCER_SITE = "learner_site", "syncer_site"
SITES = (LEARNER_SITE, LEARNER_SITE, SYNCER_SITE)  # sites 0 and 1 learn, site 2 syncs
SYNCER = 2
PAYLOAD_SHARE = 1448 / 1514  # of a capped link's rate, at MTU 1500: the rest is frame headers
TARGET_SPEEDUP, TARGET_MODEL, TARGET_COUNTERS = 5.0, 0.25, 0.05
# tiny_cpu's decoder at twice its width (0.95M parameters, 3.4x): an outer gradient of one
# fragment is then 79 KB, against which Ray's framing of each call (~2 KB a pull and its
# broadcast, measured here) is 2.4%; at tiny_cpu's 23 KB it is 5.7%.
MODEL = {"model.embed_dim": 128, "model.mlp_dim": 512}
QUIET = {"checkpoint.every_steps": 0, "checkpoint.syncer_every_s": 0.0, "eval_every": 0,
         "restore": "none", "compilation_cache_dir": "/tmp/bench_sites_jax_cache"}
# The identity outer step: Theta_p is the learner's fragment, so a one-learner run is dp.
IDENTITY = {"outer.name": "sgd", "outer.learning_rate": 1.0, "outer.momentum": 0.0,
            "merge.keep_in_flight_progress": True, "compression.outer_grad": "fp32",
            "compression.broadcast": "fp32"}


# The decoupled arm's wire formats, up and down
DECOUPLED_WIRE = {"compression.outer_grad": "bf16", "compression.broadcast": "bf16"}
# The break on purpose (--break_whole_model): every step, each learner offers its whole model
WHOLE_MODEL_EVERY_STEP = {"sync.num_fragments": 1, "sync.period": 1, "sync.overlap": 0}


def overrides(mode: str, head: str, num_steps: int, batch: int, broken: bool = False
              ) -> dict[str, Any]:
  """The command line of one arm on the sites whose head is `head` (`broken`: the decoupled
  arm with WHOLE_MODEL_EVERY_STEP)."""
  common = {"runtime": "ray", "ray.address": head, "ray.learner_resource": LEARNER_SITE,
            "ray.syncer_resource": SYNCER_SITE, "num_steps": num_steps, **MODEL, **QUIET}
  if mode == "dp":
    return {**common, "num_learners": 1, "ray.processes_per_learner": 2,
            "learner_mesh_shapes": "((2,1),)", "data.batch_size": 2 * batch,
            "sync.period": num_steps, **IDENTITY}
  if mode == "decoupled":
    return {**common, "num_learners": 2, "learner_mesh_shapes": "((1,1),)",
            "data.batch_size": batch, **DECOUPLED_WIRE,
            **(WHOLE_MODEL_EVERY_STEP if broken else {})}
  raise ValueError(f"mode={mode!r} must be dp or decoupled")


def link_bytes(links: Mapping[int, emulated_sites.LinkCounters],
               peers: Mapping[int, Mapping[Any, emulated_sites.LinkCounters]]) -> dict[str, Any]:
  """A run's counter deltas as payload bytes: per link, and by what the traffic was."""
  learners = [i for i in links if i != SYNCER]
  by_peer = lambda i, peer: peers[i][peer]
  return {
      "links": {str(i): {"sent": c.sent_payload, "received": c.received_payload,
                         "sent_frames_bytes": c.sent_bytes, "received_frames_bytes":
                         c.received_bytes} for i, c in links.items()},
      # Between the two learner sites: dp's all-reduce.
      "learner_to_learner": sum(by_peer(i, j).sent_payload for i in learners for j in learners
                                if j != i),
      "learners_to_syncer": sum(by_peer(i, SYNCER).sent_payload for i in learners),
      "syncer_to_learners": sum(by_peer(i, SYNCER).received_payload for i in learners),
      # The command and the head (the Ray control plane): the watchers' polls, forwarded posts,
      # Theta read for the evaluation.
      "with_command": {str(i): by_peer(i, "others").sent_payload
                       + by_peer(i, "others").received_payload for i in links},
  }


def paper_bytes_per_step(mode: str, num_params: int, num_fragments: int, period: int
                         ) -> dict[str, float]:
  """The model's bytes per step on a learner site's link, each way: dp's ring all-reduce over the
  two sites (fp32 gradients: a learner sends N x 4 bytes and receives as much), or a decoupled
  learner's outer gradients up and Theta_p down (`DECOUPLED_WIRE`), one fragment each H/P
  steps."""
  if mode == "dp":
    each_way = bandwidth.dp_ring_allreduce_bytes_per_step(num_params, 2, 4.0)
    return {"sent": each_way, "received": each_way}
  per_step = lambda fmt: bandwidth.bytes_per_inner_step(num_params, num_fragments, fmt, fmt,
                                                        sync_period=period) / 2
  return {"sent": per_step(DECOUPLED_WIRE["compression.outer_grad"]),
          "received": per_step(DECOUPLED_WIRE["compression.broadcast"])}


def paper_run_bytes(mode: str, per_step: Mapping[str, float], steps: int, period: int,
                    num_learners: int) -> dict[str, float]:
  """The model's bytes of a whole decoupled run between the learners and the syncer, each way:
  `per_step` over its steps plus the final flush (every fragment synced once more, H steps'
  worth). dp: its all-reduce, both learner sites together."""
  if mode == "dp":
    return {"learner_to_learner": 2 * per_step["sent"] * steps}
  steps_synced = steps + period
  return {"learners_to_syncer": num_learners * per_step["sent"] * steps_synced,
          "syncer_to_learners": num_learners * per_step["received"] * steps_synced}


def link_seconds(bytes_: float, rate_mbit: float) -> float:
  """Seconds to move `bytes_` of payload over a link capped at `rate_mbit`."""
  return bytes_ * 8 / (rate_mbit * 1e6 * PAYLOAD_SHARE)


def busiest(measured: Mapping[str, Any], mode: str) -> float:
  """Payload bytes of the busiest link direction the run waits for (every byte on a link takes
  its share of the cap, the command's too): dp's learner links (its all-reduce), or for
  decoupled any link, the syncer's included (it carries every learner's flow)."""
  links = measured["links"]
  sites = [i for i in links if mode == "decoupled" or int(i) != SYNCER]
  return max(max(links[i]["sent"], links[i]["received"]) for i in sites)


def predicted_seconds(mode: str, *, step_s: float, steps: int, link_s: float) -> float:
  """The model's wall-clock: dp waits for its all-reduce every step (t + link time); a decoupled
  learner never waits, so its run takes the longer of its steps and its syncs (sim/bandwidth.py's
  t_DDL, which counts the steps as stretched to the transfers: pessimistic)."""
  if mode == "dp":
    return steps * step_s + link_s
  return max(steps * step_s, link_s)


def row(rate_mbit: float, mode: str, summary: Mapping[str, Any], measured: Mapping[str, Any],
        period: int) -> dict[str, Any]:
  """One run's figures, before the model's prediction (`add_predictions`); `period`: its H."""
  steps = summary["learner_steps"][0]
  paper = paper_bytes_per_step(mode, summary["num_params"], summary["num_fragments"], period)
  return {
      "rate_mbit": rate_mbit, "mode": mode, "status": summary.get("status"),
      "tokens_trained": summary["tokens_trained"], "train_seconds": summary["train_seconds"],
      "tokens_per_s": summary["tokens_trained"] / summary["train_seconds"],
      "steps": steps, "num_params": summary["num_params"],
      "final_eval_loss": summary["final_eval_loss"],
      # What crossed the links by summary.json: every offer the syncer took (merged or late)
      "summary_bytes": {"learners_to_syncer": summary.get("bytes_offers_taken",
                                                          summary["bytes_learner_to_syncer"]),
                        "learners_to_syncer_merged": summary["bytes_learner_to_syncer"],
                        "syncer_to_learners": summary["bytes_syncer_to_learners"]},
      "counters": dict(measured),
      "paper_bytes_per_step": paper,
      "paper_bytes": paper_run_bytes(mode, paper, steps, period, summary["num_learners"]),
      "counted_bytes_per_step": {
          "learner_to_learner": measured["learner_to_learner"] / 2 / steps,
          "learner_to_syncer": measured["learners_to_syncer"] / summary["num_learners"] / steps},
      "late_offers": summary.get("late_offers"), "merges": summary.get("merges"),
  }


def add_predictions(rows: list[dict[str, Any]]) -> None:
  """Each row's model wall-clock, from the paper's bytes and from the counted ones, with t
  calibrated on the same mode's highest-rate row (`calibrated_step_s`)."""
  for mode in {r["mode"] for r in rows}:
    mine = [r for r in rows if r["mode"] == mode]
    top = max(mine, key=lambda r: r["rate_mbit"])
    busy = lambda r: busiest(r["counters"], mode)
    step_s = (top["train_seconds"] - (link_seconds(busy(top), top["rate_mbit"])
                                      if mode == "dp" else 0.0)) / top["steps"]
    for r in mine:
      paper = r["paper_bytes_per_step"]
      flows = 2 if mode == "decoupled" else 1  # the syncer's link carries both learners'
      paper_s = link_seconds(flows * max(paper.values()) * r["steps"], r["rate_mbit"])
      r["calibrated_step_s"] = step_s
      r["calibrated_on_mbit"] = top["rate_mbit"]
      r["model_seconds_paper_bytes"] = predicted_seconds(mode, step_s=step_s, steps=r["steps"],
                                                         link_s=paper_s)
      r["model_seconds_counted_bytes"] = predicted_seconds(
          mode, step_s=step_s, steps=r["steps"], link_s=link_seconds(busy(r), r["rate_mbit"]))


def checks(rows: Sequence[Mapping[str, Any]]) -> list[str]:
  """The targets (module docstring), each as a line: 'ok ...' or 'FAILED ...'."""
  lines = []
  by = {(r["mode"], r["rate_mbit"]): r for r in rows}
  rates = sorted({r["rate_mbit"] for r in rows})
  low, high = rates[0], rates[-1]
  if ("dp", low) in by and ("decoupled", low) in by:
    speedup = by["decoupled", low]["tokens_per_s"] / by["dp", low]["tokens_per_s"]
    lines.append(_verdict(speedup >= TARGET_SPEEDUP, f"decoupled/dp tokens/s at {low:g} Mbit/s: "
                          f"{speedup:.2f}x (target >= {TARGET_SPEEDUP:g}x)"))
  if all((m, r) in by for m in ("dp", "decoupled") for r in (low, high)):
    gap = lambda rate: (by["decoupled", rate]["final_eval_loss"] / by["dp", rate]["final_eval_loss"]
                        - 1)
    lines.append(_verdict(gap(low) <= max(gap(high), 0.0), f"eval gap to dp at {low:g} Mbit/s "
                          f"{gap(low):+.2%}, at {high:g} Mbit/s {gap(high):+.2%}"))
  for r in rows:
    error = r["model_seconds_counted_bytes"] / r["train_seconds"] - 1
    lines.append(_verdict(abs(error) <= TARGET_MODEL, f"{r['mode']} at {r['rate_mbit']:g} "
                          f"Mbit/s: model {error:+.1%} of the measured wall-clock"))
    if r["mode"] == "decoupled":
      for key in ("learners_to_syncer", "syncer_to_learners"):
        off = r["counters"][key] / r["summary_bytes"][key] - 1
        lines.append(_verdict(abs(off) <= TARGET_COUNTERS, f"decoupled at {r['rate_mbit']:g} "
                              f"Mbit/s: {key} by the counters {off:+.1%} of summary.json's"))
        # The design's bytes (P = H = 24 and the run's steps): a learner that sends more than
        # its fragments (the whole model every step, --break_whole_model) shows here.
        off = r["counters"][key] / r["paper_bytes"][key] - 1
        lines.append(_verdict(abs(off) <= TARGET_MODEL, f"decoupled at {r['rate_mbit']:g} "
                              f"Mbit/s: {key} by the counters {off:+.1%} of the bandwidth "
                              "model's"))
  return lines


def _verdict(ok: bool, text: str) -> str:
  return f"{'ok' if ok else 'FAILED'}: {text}"


def _mb(x: float) -> str:
  return f"{x / 1e6:.2f}"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
  """The markdown table of the runs."""
  head = ("| rate | mode | tokens/s | train s | model s (paper bytes / counted bytes) | "
          "link MB sent/received by counters: site 0, site 1, syncer site | "
          "learner<->learner MB counters / model | learners->syncer MB counters / summary / model | "
          "syncer->learners MB counters / summary / model | with the command MB | eval loss |\n"
          + "|---" * 11 + "|\n")
  lines = []
  for r in rows:
    c, s = r["counters"], r["summary_bytes"]
    model = lambda key, r=r: _mb(r["paper_bytes"][key]) if key in r["paper_bytes"] else "-"
    links = ", ".join(f"{_mb(c['links'][i]['sent'])}/{_mb(c['links'][i]['received'])}"
                      for i in sorted(c["links"]))
    lines.append(
        f"| {r['rate_mbit']:g} Mbit/s | {r['mode']} | {r['tokens_per_s']:,.0f} | "
        f"{r['train_seconds']:.1f} | {r['model_seconds_paper_bytes']:.1f} / "
        f"{r['model_seconds_counted_bytes']:.1f} | {links} | {_mb(c['learner_to_learner'])} / "
        f"{model('learner_to_learner')} | {_mb(c['learners_to_syncer'])} / "
        f"{_mb(s['learners_to_syncer'])} / {model('learners_to_syncer')} | "
        f"{_mb(c['syncer_to_learners'])} / {_mb(s['syncer_to_learners'])} / "
        f"{model('syncer_to_learners')} | "
        f"{_mb(sum(c['with_command'].values()))} | {r['final_eval_loss']:.4f} |")
  return head + "\n".join(lines) + "\n"


def measure(sites: emulated_sites.Sites, rate_mbit: float, mode: str, run, *, num_steps: int,
            batch: int, broken: bool = False) -> dict[str, Any]:
  """One arm at one rate: `run(overrides)` (a summary) between two readings of the counters."""
  sites.set_rate(rate_mbit)
  links, peers = sites.link_counters(), sites.peer_counters()
  summary = run(overrides(mode, sites.head_address, num_steps, batch, broken))
  if summary.get("status", "done") != "done":
    raise RuntimeError(f"{mode} at {rate_mbit:g} Mbit/s: {summary.get('status')}: "
                       f"{summary.get('log_tail', '')[-3000:]}")
  links_after, peers_after = sites.link_counters(), sites.peer_counters()
  measured = link_bytes({i: links_after[i] - links[i] for i in links},
                        {i: {p: peers_after[i][p] - peers[i][p] for p in peers[i]}
                         for i in peers})
  return row(rate_mbit, mode, summary, measured, period=_period(mode, num_steps))


def _period(mode: str, num_steps: int) -> int:
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top  (no JAX)
  return num_steps if mode == "dp" else tiny_cpu.get_config().sync.period


def main(argv: Sequence[str]) -> int:
  del argv
  reason = emulated_sites.unavailable()
  if reason:
    print(reason)
    return 2
  out = pathlib.Path(_OUT.value)
  rates = sorted((float(r) for r in _RATES.value), reverse=True)
  rows, started = [], time.time()
  with emulated_sites.Sites(len(SITES), rates[0], resources=SITES) as sites:
    for rate in rates:
      for mode in _MODES.value:
        workdir = f"/tmp/bench_sites/{mode}_{rate:g}"
        run = lambda o, w=workdir, n=f"{mode}@{rate:g}": framework_runs.framework_run(
            n, o, w, _TIMEOUT.value, env=sites.driver_env())
        rows.append(measure(sites, rate, mode, run, num_steps=_NUM_STEPS.value,
                            batch=_BATCH.value, broken=_BREAK.value))
        print(f"{mode} at {rate:g} Mbit/s: {rows[-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
  add_predictions(rows)
  verdicts = checks(rows)
  command = "python scripts/bench_sites.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
  report = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": platform.node(), "cpus": os.cpu_count(), "seconds": time.time() - started,
            "num_steps": _NUM_STEPS.value, "batch_size": _BATCH.value, "rows": rows,
            "checks": verdicts,
            "run_command": framework_runs_command(rows)}
  out.parent.mkdir(parents=True, exist_ok=True)
  out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=float) + "\n")
  out.with_suffix(".md").write_text(
      f"# bench_sites\n\n`{command}` ({report['date']}, {report['cpus']} CPUs, "
      f"{report['seconds'] / 60:.1f} min)\n\n{table(rows)}\n" + "\n".join(
          f"- {line}" for line in verdicts) + "\n")
  print(table(rows))
  print("\n".join(verdicts))
  return 1 if any(line.startswith("FAILED") for line in verdicts) else 0


def framework_runs_command(rows: Sequence[Mapping[str, Any]]) -> dict[str, str]:
  """Each arm's training command line, as run (HEAD: the head's address)."""
  del rows
  return {mode: "python -m decoupled_diloco.main --config=experiments/tiny_cpu.py " + " ".join(
      f"--config.{k}={v}" for k, v in overrides(mode, "HEAD", _NUM_STEPS.value, _BATCH.value,
                                                 _BREAK.value).items())
          for mode in _MODES.value}


if __name__ == "__main__":
  app.run(lambda argv: sys.exit(main(argv)))
