r"""The syncer's merge of one fragment against the memory floor of the same buffers, on this CPU.

A merge of fragment p reads the M offers (each learner's theta_m and the anchor it holds), Theta_p
and its outer momentum, and writes the next Theta_p, the momentum and the broadcast. The floor of
each part is the time to touch exactly those bytes once: a numpy pass that reads each buffer the
part must read (a sum, on one thread and split over two; the faster counts) and writes each buffer
it must write (into buffers of the same sizes touched beforehand, so no page is faulted in):

  screen + decode      read the M offers' values and anchors
  merge + outer step   read Theta_p and the momentum, write the next ones
  broadcast            delta broadcasts: read Theta_p and R_p, write the payload and R_p;
                       a full fp32 broadcast is Theta_p itself: nothing to write
  install              nothing (it swaps references)

The merge is `GlobalModel.screen`, `merge` and `install` on the 201.6M model's median fragment
(8.4M parameters at P = 24), every learner offering, each with arrays of its own (64-byte aligned,
as XLA's and Ray's are). Both merges run: `fused` (runtime/core/fused_merge.py) and `reference`
(`GlobalModel(fused=False)`: the per-tensor programs over numpy-encoded outer gradients, the merge
before issue 41). Floor and merges alternate within each repeat, so a load that hits one hits the
others; the fastest of `--repeats` is kept for each, and ratios are taken between figures of the
same run only. "threads" is the floor's (1 or 2, the faster), then the fused merge's worker
threads (`FusedMerge.threads`), then per path the process's CPU seconds over wall seconds while
the merge ran.

  python scripts/bench_merge.py                        # the table: M = 4, 8 x bf16/int8/int4 x fp32/int4-delta
  python scripts/bench_merge.py --rows=8:int4:fp32 --paths=fused --repeats=3
"""

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import resource
import sys
import tempfile
import time

import numpy as np

# The syncer is CPU-only by design: no accelerator backend starts (libtpu of the `tpu` extra
# would look for chips and print warnings).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

DEFAULT_ROWS = ",".join(f"{m}:{g}:{b}" for m in (4, 8) for g in ("bf16", "int8", "int4")
                        for b in ("fp32", "int4-delta"))
PARTS = ("screen + decode", "merge + outer step", "broadcast", "install")


def _cpu_s() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _faults() -> int:
  """Minor page faults of this process so far: a page of a new buffer touched for the first
  time (the kernel zeroes it), which the floor's pre-touched buffers never pay."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _aligned_copy(x: np.ndarray) -> np.ndarray:
  """A 64-byte aligned copy (XLA reads such a host array in place; numpy's own are 16-aligned)."""
  raw = np.empty(x.nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
  out[...] = x
  return out


class Floor:
  """Times the minimum memory traffic of a part: read `reads` once, write `writes` once."""

  def __init__(self, pool: concurrent.futures.ThreadPoolExecutor):
    self._pool = pool

  def _read(self, arrays, threads: int) -> None:
    if threads == 1:
      for a in arrays:
        np.add.reduce(a.reshape(-1))
      return
    halves = [h for a in arrays for h in np.array_split(a.reshape(-1), threads)]
    list(self._pool.map(lambda h: np.add.reduce(h), halves))

  def time(self, reads, writes) -> tuple[float, int]:
    """(seconds, threads) of the faster of one and two threads."""
    best = (float("inf"), 1)
    for threads in (1, 2):
      started = time.perf_counter()
      self._read(reads, threads)
      for w in writes:
        w.fill(0)
      best = min(best, (time.perf_counter() - started, threads))
    return best


@dataclasses.dataclass
class Row:
  learners: int
  outer_grad: str
  broadcast: str  # "fp32" or "int4-delta"
  best: dict = dataclasses.field(default_factory=dict)  # (path, part) -> seconds
  threads: dict = dataclasses.field(default_factory=dict)  # path -> cpu/wall
  faults: dict = dataclasses.field(default_factory=dict)  # path -> fewest page faults per merge
  cpu_s: dict = dataclasses.field(default_factory=dict)  # path -> fewest CPU seconds per merge
  workers: int | None = None  # the fused merge's worker threads


def _setup(row: Row, fragment, initial, defaults, fused: bool):
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.algorithm import outer  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.runtime.core import global_model  # pylint: disable=g-import-not-at-top

  delta = row.broadcast.endswith("-delta")
  compression = dataclasses.replace(
      defaults.compression, outer_grad=row.outer_grad,
      broadcast="fp32", broadcast_delta=row.broadcast.split("-")[0] if delta else "none")
  model = global_model.GlobalModel(
      fragments=(dataclasses.replace(fragment, index=0),), initial_params=initial,
      mesh=Mesh(np.array(jax.devices("cpu")[:1]), ("learner",)),
      outer_tx=outer.make_outer_optimizer(defaults.outer.name, defaults.outer.learning_rate,
                                          defaults.outer.momentum),
      merge=defaults.merge, compression=compression, num_learners=row.learners, fused=fused)
  model.compile()
  return model


def _offers(row: Row, initial, rng):
  from decoupled_diloco.runtime.core import messages  # pylint: disable=g-import-not-at-top

  offers = []
  for m in range(row.learners):
    values = {n: _aligned_copy(v + rng.standard_normal(v.shape, np.float32) * 1e-3)
              for n, v in initial.items()}
    anchor = {n: _aligned_copy(v) for n, v in initial.items()}  # each learner holds its own
    steps = 24 - m % 3  # unequal counters: unequal weights
    offers.append(messages.Offer(learner=m, fragment=0, step=steps, since=0, steps=steps,
                                 tokens=steps * 2048 * (1 + m % 2), anchor_version=0,
                                 values=values, anchor=anchor))
  return tuple(offers)


def _one_merge(model, offers, fused: bool):
  """Per part: (seconds, cpu seconds). The fused merge decodes in the screen, the reference in
  `merge` (its `encode_s`)."""
  f0, t0, c0 = _faults(), time.perf_counter(), _cpu_s()
  screening = model.screen(0, offers)
  model.keep_screening(screening)
  t1, c1 = time.perf_counter(), _cpu_s()
  result = model.merge(0, screening.accepted, screening.prepared)
  t2, c2 = time.perf_counter(), _cpu_s()
  model.install(result)
  t3, c3 = time.perf_counter(), _cpu_s()
  decode_s = 0.0 if fused else result.encode_s
  merge_s = (t2 - t1) - result.wire_s - decode_s
  cpu = {"screen + decode": c1 - c0, "rest": (c2 - c1) + (c3 - c2)}
  return {"screen + decode": (t1 - t0) + decode_s, "merge + outer step": merge_s,
          "broadcast": result.wire_s, "install": t3 - t2, "total": t3 - t0}, cpu, (
              t3 - t0, _faults() - f0)


def _floors(floor: Floor, model, offers, scratch):
  theta = list(model.fragment_params(0).values())
  momentum = [np.asarray(leaf) for leaf in jax_leaves(model)]
  parts = {"screen + decode": floor.time(
      [a for o in offers for a in (*o.values.values(), *o.anchor.values())], []),
           "merge + outer step": floor.time(theta + momentum, scratch["theta"] + scratch["mom"]),
           "install": (0.0, 1)}
  if scratch["payload"]:
    received = list(model.received_fragment(0).values())
    parts["broadcast"] = floor.time(theta + received, scratch["payload"] + scratch["received"])
  else:
    parts["broadcast"] = (0.0, 1)
  parts["total"] = (sum(s for s, _ in parts.values()), max(t for _, t in parts.values()))
  return parts


def jax_leaves(model):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree.leaves(model.state()[0]["opt"])


def _scratch(row: Row, model, block_size: int):
  from decoupled_diloco.algorithm import compression  # pylint: disable=g-import-not-at-top

  theta = list(model.fragment_params(0).values())
  touch = lambda a: (a.fill(1), a)[1]
  scratch = {"theta": [touch(np.empty_like(v)) for v in theta],
             "mom": [touch(np.empty_like(np.asarray(v))) for v in jax_leaves(model)],
             "payload": [], "received": []}
  if row.broadcast.endswith("-delta"):
    fmt = row.broadcast.split("-")[0]
    scratch["payload"] = [touch(np.empty(compression.encoded_nbytes(v.size, fmt, block_size),
                                         np.uint8)) for v in theta]
    scratch["received"] = [touch(np.empty_like(v)) for v in theta]
  return scratch


def run_row(row: Row, fragment, shapes, defaults, paths, repeats: int, pool) -> Row:
  floor = Floor(pool)
  rng = np.random.default_rng(0)
  initial = {n: _aligned_copy(rng.standard_normal(shapes[n].shape, np.float32) * 0.02)
             for n in fragment.names}
  models = {path: _setup(row, fragment, initial, defaults, path == "fused") for path in paths}
  offers = _offers(row, initial, rng)
  scratch = _scratch(row, models[paths[0]], defaults.compression.block_size)
  for path in paths:
    _one_merge(models[path], offers, path == "fused")  # touches every page and program once
  cpu_wall = {path: [0.0, 0.0] for path in paths}
  for _ in range(repeats):
    for path in paths:
      for part, (seconds, threads) in _floors(floor, models[path], offers, scratch).items():
        key = ("floor", part)
        if seconds < row.best.get(key, (float("inf"),))[0]:
          row.best[key] = (seconds, threads)
      parts, cpu, (wall, faults) = _one_merge(models[path], offers, path == "fused")
      cpu_wall[path][0] += sum(cpu.values())
      cpu_wall[path][1] += wall
      row.faults[path] = min(row.faults.get(path, faults), faults)
      row.cpu_s[path] = min(row.cpu_s.get(path, float("inf")), sum(cpu.values()))
      for part, seconds in parts.items():
        row.best[(path, part)] = min(row.best.get((path, part), float("inf")), seconds)
  row.threads = {path: round(c / w, 2) for path, (c, w) in cpu_wall.items()}
  if "fused" in models:
    row.workers = models["fused"]._fused.threads  # pylint: disable=protected-access
  return row


def _report(rows, paths, args, machine) -> dict:
  out = {"command": "python scripts/bench_merge.py " + " ".join(sys.argv[1:]),
         "machine": machine, "repeats": args.repeats, "rows": []}
  for row in rows:
    floor = {p: row.best[("floor", p)][0] for p in PARTS + ("total",)}
    entry = {"learners": row.learners, "outer_grad": row.outer_grad,
             "broadcast": row.broadcast, "floor_s": floor,
             "floor_threads": row.best[("floor", "total")][1], "merge_threads": row.threads,
             "fused_worker_threads": row.workers,
             "page_faults_per_merge": row.faults, "cpu_s_per_merge": row.cpu_s}
    for path in paths:
      seconds = {p: row.best[(path, p)] for p in PARTS + ("total",)}
      entry[path] = {"seconds": seconds,
                     "ratio": {p: (seconds[p] / floor[p] if floor[p] > 0 else None)
                               for p in PARTS + ("total",)}}
    out["rows"].append(entry)
  return out


def _markdown(report, paths) -> str:
  lines = [f"`{report['command']}` on {report['machine']}; fastest of {report['repeats']} "
           "repeats, floor and merges alternating within each repeat. Seconds per merge of one "
           "8.4M-parameter fragment; ratio = merge / floor of the same run.", "",
           "| M | outer gradients | broadcast | floor (s) | " + " | ".join(
               f"{p} (s) | {p} / floor" for p in paths) + " | threads (floor; fused workers, CPU s / wall s) | "
           "page faults per merge |",
           "|---|---|---|---|" + "---|---|" * len(paths) + "---|---|"]
  for r in report["rows"]:
    cells = [str(r["learners"]), r["outer_grad"], r["broadcast"], f"{r['floor_s']['total']:.4f}"]
    for p in paths:
      cells += [f"{r[p]['seconds']['total']:.4f}", f"{r[p]['ratio']['total']:.2f}x"]
    workers = r.get("fused_worker_threads")
    cells.append(f"{r['floor_threads']}; " + ("" if workers is None else f"{workers} workers, ")
                 + ", ".join(
        f"{p} {t}" for p, t in r["merge_threads"].items()))
    cells.append(", ".join(f"{p} {n}" for p, n in r["page_faults_per_merge"].items()))
    lines.append("| " + " | ".join(cells) + " |")
  lines += ["", "Per part (seconds, and ratio to the part's floor):", "",
            "| M | outer gradients | broadcast | path | " + " | ".join(PARTS) + " |",
            "|---|---|---|---|" + "---|" * len(PARTS)]
  for r in report["rows"]:
    for p in paths:
      cells = [str(r["learners"]), r["outer_grad"], r["broadcast"], p]
      for part in PARTS:
        ratio = r[p]["ratio"][part]
        cells.append(f"{r[p]['seconds'][part]:.4f}"
                     + ("" if ratio is None else f" ({ratio:.2f}x)"))
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--embed_dim", type=int, default=1024)
  parser.add_argument("--num_layers", type=int, default=12)
  parser.add_argument("--num_heads", type=int, default=16)
  parser.add_argument("--head_dim", type=int, default=64)
  parser.add_argument("--mlp_dim", type=int, default=4096)
  parser.add_argument("--fragments", type=int, default=24)
  parser.add_argument("--rows", default=DEFAULT_ROWS,
                      help="comma-separated learners:outer_grad:broadcast (fp32 or FMT-delta)")
  parser.add_argument("--paths", default="fused,reference")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", default="results/bench_merge_floor.json")
  parser.add_argument("--learner_step_s", type=float, default=0.0,
                      help="> 0: whether the syncer keeps up with learner steps this long at "
                           "M = 1, 4, 8 (tiny_cpu's wire formats, the fused merge), on N cores")
  args = parser.parse_args()
  if args.learner_step_s > 0:
    args.rows = args.rows if args.rows != DEFAULT_ROWS else "1:bf16:fp32,4:bf16:fp32,8:bf16:fp32"
    args.paths = "fused"
    if args.out == parser.get_default("out"):
      args.out = "results/bench_merge_keepup.json"

  from decoupled_diloco import settings  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.algorithm import fragments as fragments_lib  # pylint: disable=g-import-not-at-top
  from decoupled_diloco.lm import model as model_lib  # pylint: disable=g-import-not-at-top
  from experiments import tiny_cpu  # pylint: disable=g-import-not-at-top

  config = tiny_cpu.get_config()
  config.workdir = tempfile.gettempdir()  # nothing is written there: the report goes to --out
  defaults = settings.validate(config)
  cfg = dataclasses.replace(defaults.model, embed_dim=args.embed_dim, num_layers=args.num_layers,
                            num_heads=args.num_heads, head_dim=args.head_dim,
                            mlp_dim=args.mlp_dim, max_seq_len=1024)
  shapes = model_lib.param_shapes(cfg)
  parts = fragments_lib.partition(shapes, args.fragments, "balanced",
                                  embedding_names=(model_lib.EMBEDDING_NAME,))
  fragment = sorted(parts, key=lambda f: (sum(f.sizes), f.index))[len(parts) // 2]
  paths = tuple(args.paths.split(","))
  load_before = os.getloadavg()[0]  # other jobs on the host starve the merge's second thread
  machine = f"{os.cpu_count()} CPU cores"
  rows = []
  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    for spec in args.rows.split(","):
      learners, outer_grad, broadcast = spec.split(":")
      row = run_row(Row(int(learners), outer_grad, broadcast), fragment, shapes, defaults,
                    paths, args.repeats, pool)
      rows.append(row)
      report = _report([row], paths, args, machine)["rows"][0]
      print(f"M={learners} {outer_grad} {broadcast}: floor {report['floor_s']['total']:.4f} s | "
            + " | ".join(f"{p} {report[p]['seconds']['total']:.4f} s "
                         f"({report[p]['ratio']['total']:.2f}x)" for p in paths), flush=True)
  report = _report(rows, paths, args, machine)
  report["load_average_1min"] = {"start": load_before, "end": os.getloadavg()[0]}
  report["fragment_params"] = int(sum(fragment.sizes))
  report["model_params"] = int(model_lib.num_params(shapes))
  markdown = _markdown(report, paths) + (
      f"\nThe host's 1-minute load average: {load_before:.1f} at the start, "
      f"{report['load_average_1min']['end']:.1f} at the end.\n")
  if args.learner_step_s > 0:
    markdown = _keep_up(report, args.learner_step_s) + "\n" + markdown
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  with open(os.path.splitext(args.out)[0] + ".md", "w", encoding="utf-8") as f:
    f.write(markdown)
  print(markdown)


def _keep_up(report, step_s: float) -> str:
  """With P = H one fragment falls due per learner step: a host keeps up when the merges' CPU
  seconds per step fit its cores, assuming merges of different fragments (`syncer.num_workers`)
  share the cores without slowing each other. They share the memory bus, which a merge at a few
  times its floor does not saturate on one core; on many cores that assumption is untested."""
  cores = os.cpu_count()
  lines = [f"Learner steps of {step_s} s, P = H (one merge per step), this host: {cores} cores. "
           "Cores needed = CPU seconds per merge / step seconds, rounded up (the fastest merge "
           "of the run; merges of different fragments on separate cores).", "",
           "| M | outer gradients | wall s per merge | CPU s per merge | cores needed | "
           f"keeps up on {cores} cores |", "|---|---|---|---|---|---|"]
  for r in report["rows"]:
    cpu = r["cpu_s_per_merge"]["fused"]
    need = max(1, math.ceil(cpu / step_s))
    lines.append(f"| {r['learners']} | {r['outer_grad']} | {r['fused']['seconds']['total']:.4f} | "
                 f"{cpu:.4f} | {need} | {'yes' if need <= cores else 'no'} |")
    r["keep_up"] = {"step_s": step_s, "cores_needed": need, "host_cores": cores,
                    "keeps_up": need <= cores}
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  main()
