r"""How fast the syncer merges one fragment of a real-size model, on this host's CPU.

With P = H one fragment falls due per learner step, so the syncer keeps up only if a merge (encode
the outer gradients, the merge program, Theta to host, broadcast encoding) takes less than a step;
with `syncer.num_workers` = W merges of different fragments run at once. This times
`GlobalModel.merge` + `install` on the fragments of a model of the given size, with M learners
offering, and prints the learner step time the syncer can keep up with. No accelerator is used: the
syncer is CPU-only by design.

  python scripts/bench_merge.py                         # bench_accelerator's 201.6M model, P = 24
  python scripts/bench_merge.py --learners=4 --workers=2 --outer_grad=bf16
"""

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

# The syncer is CPU-only by design: no accelerator backend starts (libtpu of the `tpu` extra
# would look for chips and print warnings).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--embed_dim", type=int, default=1024)
  parser.add_argument("--num_layers", type=int, default=12)
  parser.add_argument("--num_heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--mlp_dim", type=int, default=4096)
  parser.add_argument("--fragments", type=int, default=24)
  parser.add_argument("--learners", type=int, default=1)
  parser.add_argument("--workers", type=int, default=1)
  parser.add_argument("--outer_grad", default="fp32")
  parser.add_argument("--broadcast", default="fp32")
  parser.add_argument("--merges", type=int, default=24, help="merges timed (one per fragment)")
  parser.add_argument("--out", default="results/bench_merge.json")
  args = parser.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh
  from decoupled_diloco import settings
  from decoupled_diloco.algorithm import fragments as fragments_lib
  from decoupled_diloco.algorithm import outer
  from decoupled_diloco.lm import model as model_lib
  from decoupled_diloco.runtime.core import global_model
  from decoupled_diloco.runtime.core import messages
  from experiments import tiny_cpu

  # The default experiment's settings, with this model's shape and the wire formats asked for.
  config = tiny_cpu.get_config()
  config.workdir = tempfile.gettempdir()  # nothing is written there: the report goes to --out
  defaults = settings.validate(config)
  cfg = dataclasses.replace(defaults.model, embed_dim=args.embed_dim, num_layers=args.num_layers,
                            num_heads=args.num_heads, head_dim=args.head_dim,
                            mlp_dim=args.mlp_dim, max_seq_len=1024)
  shapes = model_lib.param_shapes(cfg)
  num_params = model_lib.num_params(shapes)
  fragments = fragments_lib.partition(shapes, args.fragments, "balanced",
                                      embedding_names=(model_lib.EMBEDDING_NAME,))
  rng = np.random.default_rng(0)
  initial = {n: rng.normal(size=s.shape).astype(np.float32) * 0.02 for n, s in shapes.items()}
  model = global_model.GlobalModel(
      fragments=fragments, initial_params=initial,
      mesh=Mesh(np.array(jax.devices("cpu")[:1]), ("learner",)),
      outer_tx=outer.make_outer_optimizer(defaults.outer.name, defaults.outer.learning_rate,
                                          defaults.outer.momentum),
      merge=defaults.merge,
      compression=dataclasses.replace(defaults.compression, outer_grad=args.outer_grad,
                                      broadcast=args.broadcast),
      num_learners=args.learners)
  compile_s = model.compile()

  def offers(p):
    out = []
    for m in range(args.learners):
      values = {n: initial[n] + rng.normal(size=initial[n].shape).astype(np.float32) * 1e-3
                for n in fragments[p].names}
      out.append(messages.Offer(learner=m, fragment=p, step=24, since=0, steps=24, tokens=24_000,
                                anchor_version=0, values=values,
                                anchor={n: initial[n] for n in fragments[p].names}))
    return tuple(out)

  prepared = [offers(p % args.fragments) for p in range(args.merges)]
  parts = {"encode_s": [], "merge_s": [], "wire_s": []}

  def one(p):
    return model.merge(p % args.fragments, prepared[p])

  started = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
    # Fragments are independent; a fragment's merges stay in order (as in the syncer).
    for batch in range(0, args.merges, args.fragments):
      for result in pool.map(one, range(batch, min(batch + args.fragments, args.merges))):
        model.install(result)
        for key in parts:
          parts[key].append(getattr(result, key))
  seconds = time.perf_counter() - started
  per_merge = seconds / args.merges
  fragment_params = num_params / args.fragments
  report = {
      "num_params": num_params, "fragments": args.fragments, "learners": args.learners,
      "workers": args.workers, "outer_grad": args.outer_grad, "broadcast": args.broadcast,
      "compile_s": compile_s, "seconds_per_merge": per_merge,
      "median_parts_s": {k: float(np.median(v)) for k, v in parts.items()},
      "fragment_params": fragment_params,
      "keeps_up_with_steps_of_s": per_merge,  # P = H: one merge per learner step
      "machine": f"{os.cpu_count()} CPU cores",
  }
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  print(f"{num_params / 1e6:.1f}M parameters in {args.fragments} fragments "
        f"({fragment_params / 1e6:.2f}M each), {args.learners} learner(s), {args.workers} "
        f"worker(s), {args.outer_grad} outer gradients: {per_merge * 1e3:.0f} ms per merge "
        f"(encode {np.median(parts['encode_s']) * 1e3:.0f} ms, program "
        f"{np.median(parts['merge_s']) * 1e3:.0f} ms, wire {np.median(parts['wire_s']) * 1e3:.0f}"
        f" ms). With P = H the syncer keeps up with learner steps of {per_merge:.2f} s or more.")
  print(json.dumps(report, indent=2))


if __name__ == "__main__":
  main()
