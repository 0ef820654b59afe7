r"""One learner at real size on whatever accelerator is here: dp vs decoupled vs a plain JAX step.

The benchmark of docs/accelerators.md. It runs, each in its own process (so host peak RSS and
device peak memory are per run):
  - `dp`: the framework in data-parallel mode;
  - `decoupled_identity`: decoupled with the outer step that is the identity (SGD lr 1, no
    momentum, keep_in_flight_progress, fp32 outer gradients). With one learner it must track dp:
    its final eval loss over dp's is the pipeline's invariant (CPU: within 0.1%, GPU: 0.3%);
  - `decoupled`: decoupled with the default outer step (Nesterov lr 0.7, momentum 0.6);
  - `reference`: a plain JAX train step of the same shape written without the framework (layers
    under `jax.lax.scan`, fp32 parameters, activations in the model dtype, optax AdamW, donated
    state), for the ratio of the framework's learner tokens/s to it.
and writes the build split, tokens/s per device, MFU (analytic model FLOPs counting attention over
the device's dense peak), host peak RSS, device peak memory, merges vs due and eval seconds to
results/accelerator_<platform>_<size>.{json,md}.

  python scripts/bench_accelerator.py                     # on a GPU: the 201.6M config, 600 steps
  python scripts/bench_accelerator.py --size=34m          # on CPU: 33.7M parameters, 48 steps
  python scripts/bench_accelerator.py --size=small --runs=dp,decoupled_identity

This process never imports JAX: on a GPU it would take the device's memory from the runs.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# None imports JAX.
import framework_runs  # pylint: disable=g-import-not-at-top,wrong-import-position
from decoupled_diloco.lm import flops as flops_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

# Model and data shapes. 201.6M: the configuration for one H100. 34m: the CPU host-memory check
# (33.7M parameters). small: experiments/tiny_cpu.py's model.
SIZES = {
    "200m": {"model.embed_dim": 1024, "model.num_layers": 12, "model.num_heads": 16,
             "model.head_dim": 64, "model.mlp_dim": 4096, "model.max_seq_len": 1024,
             "model.dtype": "bfloat16", "model.scan_layers": True, "data.seq_len": 1024,
             "data.batch_size": 32},
    "34m": {"model.embed_dim": 512, "model.num_layers": 8, "model.num_heads": 8,
            "model.head_dim": 64, "model.mlp_dim": 2048, "model.max_seq_len": 128,
            "model.dtype": "float32", "data.seq_len": 128, "data.batch_size": 4},
    "small": {"model.embed_dim": 64, "model.num_layers": 4, "model.num_heads": 4,
              "model.head_dim": 16, "model.mlp_dim": 256, "model.max_seq_len": 128,
              "model.dtype": "float32", "data.seq_len": 128, "data.batch_size": 16},
}
DEFAULT_STEPS = {"200m": 600, "34m": 48, "small": 200}

IDENTITY = {"outer.name": "sgd", "outer.learning_rate": 1.0, "outer.momentum": 0.0,
            "merge.keep_in_flight_progress": True, "compression.outer_grad": "fp32"}
_LATER_RUN_S = 45.0  # of --budget_s, kept for each run still to come

RUNS = {"dp": {"mode": "dp"}, "decoupled_identity": {"mode": "decoupled", **IDENTITY},
        "decoupled": {"mode": "decoupled"}}


def common_overrides(size: dict, steps: int, platform: str) -> dict:
  """The config overrides every framework run of this benchmark shares: one learner of `size`."""
  return {**size, "num_steps": steps, "eval_every": 0, "eval_batches": 2, "log_every": 25,
          "inner.warmup_steps": min(40, steps // 4), "num_learners": 1,
          # tiny_cpu's settings before the quality study (docs/studies.md, "Quality gap to dp")
          # raised them for its 0.28M model.
          "inner.learning_rate": 3e-3, "outer.momentum": 0.6,
          "learner_mesh_shapes": "((1,1),)", "devices.platform": platform,
          "devices.num_fake_cpu_devices": 2 if platform == "cpu" else 0,
          "checkpoint.every_steps": 0}  # no checkpoint writes in the timed steps


def flops_per_token(size: dict) -> float:
  """Training FLOPs per token, counted as the runtime counts them (lm/flops.py)."""
  shape = types.SimpleNamespace(vocab_size=256, **{
      k.split(".")[1]: size[k] for k in ("model.embed_dim", "model.num_layers",
                                         "model.num_heads", "model.head_dim", "model.mlp_dim")})
  return flops_lib.model_flops_per_token(shape, size["data.seq_len"])


def num_params(size: dict) -> int:
  d, layers = size["model.embed_dim"], size["model.num_layers"]
  hk, f = size["model.num_heads"] * size["model.head_dim"], size["model.mlp_dim"]
  return 256 * d + layers * (4 * d * hk + 3 * d * f + 2 * d) + d


def _reference_run(size: dict, steps: int, platform: str, timeout: int) -> dict:
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, __file__, "--reference", json.dumps(size), "--steps", str(steps)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-6000:])
    raise RuntimeError("the reference step failed")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def reference_step(size: dict, steps: int) -> dict:
  """A plain JAX train step of the model's shape, timed: tokens/s on one device.

  Written for this benchmark only, with no framework code: stacked layers under lax.scan, RMSNorm,
  rotary attention (cuDNN flash attention on a GPU when the sequence allows it), GeGLU MLP, tied
  embedding, fp32 parameters with activations in the model dtype, optax AdamW, donated state.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import optax
  started = time.perf_counter()
  d, layers = size["model.embed_dim"], size["model.num_layers"]
  h, k, f = size["model.num_heads"], size["model.head_dim"], size["model.mlp_dim"]
  seq, batch, vocab = size["data.seq_len"], size["data.batch_size"], 256
  dt = jnp.bfloat16 if size["model.dtype"] == "bfloat16" else jnp.float32
  device = jax.devices()[0]
  impl = "cudnn" if device.platform == "gpu" and dt == jnp.bfloat16 and seq % 64 == 0 else "xla"

  def init(key):
    keys = jax.random.split(key, 8)

    def normal(key, shape, fan_in):
      return jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(fan_in)

    return {"embed": normal(keys[0], (vocab, d), d), "final_norm": jnp.zeros((d,)),
            "layers": {"norm1": jnp.zeros((layers, d)), "norm2": jnp.zeros((layers, d)),
                       "q": normal(keys[1], (layers, d, h, k), d),
                       "k": normal(keys[2], (layers, d, h, k), d),
                       "v": normal(keys[3], (layers, d, h, k), d),
                       "o": normal(keys[4], (layers, h, k, d), h * k),
                       "gate": normal(keys[5], (layers, d, f), d),
                       "up": normal(keys[6], (layers, d, f), d),
                       "down": normal(keys[7], (layers, f, d), f)}}

  def rms_norm(x, scale):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (normed * (1.0 + scale)).astype(x.dtype)

  half = jnp.arange(k // 2, dtype=jnp.float32)
  angle = jnp.arange(seq, dtype=jnp.float32)[:, None] * 10_000.0 ** (-2.0 * half / k)
  sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]

  def rotate(x):
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

  def block(x, w):
    y = rms_norm(x, w["norm1"])
    q, kk, v = (jnp.einsum("bld,dhk->blhk", y, w[n].astype(dt)) for n in ("q", "k", "v"))
    att = jax.nn.dot_product_attention(rotate(q), rotate(kk), v, is_causal=True,
                                       implementation=impl)
    x = x + jnp.einsum("blhk,hkd->bld", att, w["o"].astype(dt))
    y = rms_norm(x, w["norm2"])
    hidden = jax.nn.gelu(y @ w["gate"].astype(dt)) * (y @ w["up"].astype(dt))
    return x + hidden @ w["down"].astype(dt), None

  def loss_fn(params, tokens):
    x = jnp.take(params["embed"], tokens[:, :-1], axis=0).astype(dt) * jnp.sqrt(d).astype(dt)
    x, _ = jax.lax.scan(block, x, params["layers"])
    x = rms_norm(x, params["final_norm"])
    logits = jnp.einsum("bld,vd->blv", x, params["embed"].astype(dt),
                        preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  tx = optax.adamw(3e-4, b2=0.95, weight_decay=0.1)

  def train_step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(train_step, donate_argnums=(0, 1))
  params = jax.jit(init)(jax.random.key(0))
  opt_state = jax.jit(tx.init)(params)
  tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, vocab)
  params, opt_state, loss = step(params, opt_state, tokens)
  float(loss)
  compile_s = time.perf_counter() - started
  warmup = min(5, steps // 4)
  for _ in range(warmup):
    params, opt_state, loss = step(params, opt_state, tokens)
  float(loss)
  timed = max(steps - warmup, 1)
  started = time.perf_counter()
  for _ in range(timed):
    params, opt_state, loss = step(params, opt_state, tokens)
  float(loss)
  seconds = time.perf_counter() - started
  stats = device.memory_stats() or {}
  return {"tokens_per_s": batch * seq * timed / seconds, "steps": timed,
          "compile_s": compile_s, "attention": impl, "device_kind": device.device_kind,
          "device_peak_bytes": stats.get("peak_bytes_in_use")}


def _run_one(name: str, size: dict, steps: int, platform: str, common: dict,
             timeout_s: float) -> dict:
  """One run's figures; a run that failed or ran out of time is recorded with its status."""
  tokens_per_step = size["data.seq_len"] * size["data.batch_size"]
  if name == "reference":
    try:
      return {"status": "done", **_reference_run(size, steps, platform, timeout_s)}
    except (RuntimeError, subprocess.TimeoutExpired) as err:
      return {"status": "failed", "error": str(err)[-2000:]}
  workdir = f"/tmp/bench_accelerator/{name}"
  shutil.rmtree(workdir, ignore_errors=True)  # afresh: a run resumes the checkpoint it finds
  s = framework_runs.framework_run(name, {**common, **RUNS[name]}, workdir, timeout_s)
  if s["status"] != "done":
    sys.stderr.write(s.get("log_tail", ""))
    return {k: s.get(k) for k in ("status", "returncode", "process_seconds",
                                  "process_to_first_step_s", "log_tail")}
  return {"status": "done", "tokens_per_s": s["learner_steps_per_s"][0] * tokens_per_step,
          "final_eval_loss": s["final_eval_loss"], "host_peak_rss_bytes": s["host_peak_rss_bytes"],
          "device_peak_bytes": s["device_peak_bytes"], "build_seconds": s["build_seconds"],
          **{k: s[k] for k in ("init_compile_s", "train_compile_s", "eval_compile_s",
                               "syncer_compile_s", "eval_seconds", "merges", "merges_due",
                               "merges_before_flush", "late_offers", "double_merged_offers",
                               "unmerged_steps_at_end", "num_params", "process_seconds",
                               "first_step_s", "process_to_first_step_s")
             if k in s},
          "syncer_held_bytes": s.get("syncer_held_bytes")}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--size", default=None, choices=sorted(SIZES),
                      help="model preset (default: 200m on an accelerator, 34m on CPU)")
  parser.add_argument("--steps", type=int, default=None, help="inner steps per run")
  parser.add_argument("--runs", default="dp,decoupled_identity,decoupled,reference")
  parser.add_argument("--attention", default=None, help="config.model.attention override")
  parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                      help="another config override for the framework runs, e.g. "
                           "syncer.num_workers=8 or compilation_cache_dir=/tmp/jax_cache")
  parser.add_argument("--out", default=None, help="output prefix (default results/accelerator_*)")
  parser.add_argument("--timeout_s", type=int, default=3600, help="per run")
  parser.add_argument("--budget_s", type=float, default=None,
                      help="the whole script: a run may take what is left less 45 s for each "
                           "later run (a run past its time is stopped and recorded as such)")
  parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.reference:
    print(json.dumps(reference_step(json.loads(args.reference), args.steps)))
    return

  started = time.perf_counter()
  probe = framework_runs.probe()
  platform = probe["platform"]
  size_name = args.size or ("34m" if platform == "cpu" else "200m")
  size, steps = SIZES[size_name], args.steps or DEFAULT_STEPS[size_name]
  common = common_overrides(size, steps, platform)
  if args.attention:
    common["model.attention"] = args.attention
  for item in args.set:
    field, _, value = item.partition("=")
    common[field] = value
  print(f"{probe['kind']} ({platform}), size {size_name}: {num_params(size) / 1e6:.1f}M "
        f"parameters, {steps} steps per run", flush=True)
  out = args.out or str(ROOT / "results" / f"accelerator_{platform}_{size_name}")
  names = args.runs.split(",")
  results = {}
  for i, name in enumerate(names):
    timeout_s = args.timeout_s
    if args.budget_s is not None:
      # The first run compiles for the rest (they share config.compilation_cache_dir when it is
      # set): it may take what is left but a minimum for each later run.
      left = args.budget_s - (time.perf_counter() - started) - 5.0
      timeout_s = min(timeout_s, max(left - _LATER_RUN_S * (len(names) - i - 1), 10.0))
    r = _run_one(name, size, steps, platform, common, timeout_s)
    results[name] = r
    print(f"{name:20s} " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in r.items() if k != "log_tail"), flush=True)
    _report(out, probe, size_name, size, steps, results, args.set,  # after every run
            "python scripts/bench_accelerator.py " + " ".join(sys.argv[1:]))


def _report(out: str, probe: dict, size_name: str, size: dict, steps: int, results: dict,
            overrides: list[str], command: str) -> None:
  platform = probe["platform"]
  peak = framework_runs.peak_flops(probe["kind"])
  per_token = flops_per_token(size)
  done = {name: r for name, r in results.items() if r["status"] == "done"}
  for r in done.values():
    r["mfu"] = per_token * r["tokens_per_s"] / peak if peak else None
  ratios = {}
  if "dp" in done:
    dp = done["dp"]
    for name in ("decoupled_identity", "decoupled"):
      if name in done:
        ratios[f"{name}_eval_over_dp"] = done[name]["final_eval_loss"] / dp["final_eval_loss"]
        ratios[f"{name}_steps_over_dp"] = done[name]["tokens_per_s"] / dp["tokens_per_s"]
        ratios[f"{name}_rss_over_dp_bytes"] = (done[name]["host_peak_rss_bytes"]
                                              - dp["host_peak_rss_bytes"])
    if "reference" in done:
      ratios["dp_over_reference_tokens_per_s"] = dp["tokens_per_s"] / done["reference"][
          "tokens_per_s"]
  fp32_param_bytes = 4 * num_params(size)
  report = {"device": probe, "size": size_name, "size_config": size, "steps": steps,
            "overrides": overrides, "command": command, "num_params": num_params(size),
            "fp32_param_bytes": fp32_param_bytes, "flops_per_token": per_token,
            "peak_flops": peak, "runs": results, "ratios": ratios,
            "rss_allowance_bytes": 4 * fp32_param_bytes + 500_000_000}
  os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
  with open(out + ".json", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  lines = [f"{probe['kind']} ({platform}), {num_params(size) / 1e6:.1f}M parameters, {steps} "
           f"steps, one learner. `{command}`", "",
           "| run | tokens/s | MFU | final eval | build s (init / train / eval / syncer) | first "
           "step s | host peak RSS GB | device peak GB | merges / due |",
           "|---|---|---|---|---|---|---|---|---|"]
  gb = lambda b: f"{b / 1e9:.2f}" if b else "-"
  for name, r in results.items():
    if r["status"] != "done":
      lines.append(f"| {name} | {r['status']} | | | | | | | |")
      continue
    build = (f"{r['build_seconds']:.1f} ({r['init_compile_s']:.1f} / {r['train_compile_s']:.1f} / "
             f"{r['eval_compile_s']:.1f} / {r['syncer_compile_s']:.1f})"
             if "build_seconds" in r else f"{r['compile_s']:.1f}")
    first = r.get("process_to_first_step_s")
    merges = f"{r['merges_before_flush']} / {r['merges_due']}" if r.get("merges_due") else "-"
    mfu = "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {mfu} | "
                 f"{r.get('final_eval_loss', float('nan')):.4f} | {build} | "
                 f"{'-' if first is None else f'{first:.1f}'} | "
                 f"{gb(r.get('host_peak_rss_bytes'))} | {gb(r.get('device_peak_bytes'))} | "
                 f"{merges} |")
  lines += ["", *(f"- {k}: {v:.4f}" if abs(v) < 1e6 else f"- {k}: {v / 1e9:.3f} GB"
                  for k, v in ratios.items())]
  with open(out + ".md", "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
  print("\n".join(lines), flush=True)


if __name__ == "__main__":
  main()
