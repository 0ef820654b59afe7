r"""Compiles every learner program of an experiment for its real TPU topology, on this host.

  python scripts/aot_compile.py --config=experiments/gemma_2b_v5p.py
  python scripts/aot_compile.py --config=experiments/tiny_cpu.py --topology=v5p:2x2x1 \
      '--config.learner_mesh_shapes=((2,2),)'   # the topology's 4 chips: one learner mesh
  python scripts/aot_compile.py --config=experiments/dense_5b_v5p.py --config.model.remat=auto
  python scripts/aot_compile.py --config=experiments/gemma_2b_v5p.py --num_slices=8
  python scripts/aot_compile.py --config=experiments/hetero_v6e_v5p.py \
      --config.model.attention=splash --name=hetero_v6e_v5p_splash

No TPU is needed: libtpu (the `tpu` extra) gives the compile-only devices of a named topology and
the TPU compiler (runtime/tpu_aot.py). Each distinct learner is compiled on its topology (the
config's `devices.tpu_topologies`, or --topology for all), and for each of its programs (train
step, eval step, publication copy, apply of a broadcast, sampling step) this prints and writes
HBM per chip against the chip's, the compiled FLOPs (matmuls, and the splash attention kernels
counted from their shapes; any other custom call listed as uncounted) beside lm/flops.py's, every
collective with its bytes and mesh axes; for the train step a roofline (step time, MFU ceiling,
tokens/s per slice); and for the syncer the merges falling due at that pace, their bytes, a merge
of the median fragment timed on this host, and the `syncer.num_workers` that keep up.
With --num_slices=N the learners are compiled as on a multi-slice pod: N slices of each topology,
every learner placed by the run's own carving on a slice of its own and compiled on its devices,
with the slice it landed on and whether any of its collectives joins devices of two slices.
Writes results/aot_<experiment>.json and .md (aot_<experiment>_multislice.* with --num_slices;
--out_dir). A check before booking chips: it exits 3, with one line naming them, when any program
does not fit its chips' HBM or does not compile (2 for a bad config or flag, as every command).
"""

import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import sys
import time

# The TPU compiler needs no TPU backend: only CPU devices start in this process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags  # pylint: disable=g-import-not-at-top
from ml_collections import config_flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from decoupled_diloco import errors  # pylint: disable=g-import-not-at-top
from decoupled_diloco import settings as settings_lib
from decoupled_diloco.runtime.core import slices
from decoupled_diloco.runtime.core.syncer import load as syncer_load
from decoupled_diloco.runtime import tpu_aot

_CONFIG = config_flags.DEFINE_config_file("config", None, "Experiment config file.")
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "TPU topology of every learner (v5p:4x4x4, v6e:8x8, v5e:1x1): replaces "
    "config.devices.tpu_topologies before the config is validated; default each learner's entry "
    "there.")
_NUM_SLICES = flags.DEFINE_integer(
    "num_slices", 0, "Compile for a multi-slice pod: this many slices of each topology the "
    "learners name, every learner placed on its own slice by the run's carving and compiled on "
    "that slice's devices; the report says where each landed and whether any collective joins "
    "two slices. 0: each distinct learner once, on its topology alone. Writes "
    "aot_<experiment>_multislice.*")
_OUT_DIR = flags.DEFINE_string("out_dir", "results", "Where aot_<experiment>.{json,md} go.")
_NAME = flags.DEFINE_string("name", None, "Report name; default the config file's.")
_MERGE_TIMING = flags.DEFINE_bool("merge_timing", True, "Time the syncer's merge on this host.")
_SYNCER_ONLY = flags.DEFINE_bool(
    "syncer_only", False, "Compile nothing: time the syncer's merge on this host again and rewrite "
    "the syncer part of an existing report (--out_dir's aot_<name>.json, which gives the "
    "learners' roofline steps).")
flags.mark_flags_as_required(["config"])

_GIB = 1024**3
# Exit status when a program of the experiment does not fit or does not compile.
EXIT_DOES_NOT_FIT = 3
_SHARD_COUNTS = (1, 2, 4, 8)  # the shardings the syncer's sizing is given for (those <= P)


def _gib(n):
  return n / _GIB


def _program_record(p, chip):
  fit, hlo = p.fit, p.hlo
  record = {
      "program": p.program, "count": p.count, "compile_s": round(p.compile_s, 2),
      "refused_by_compiler": fit.refusal or None, "compile_error": p.error or None,
      "alongside": p.alongside, "alongside_bytes": fit.alongside_bytes,
      "usable_hbm_bytes": fit.usable_bytes,
  }
  if fit.memory is not None:
    m = fit.memory
    record.update({"argument_bytes": m.argument_bytes, "output_bytes": m.output_bytes,
                   "alias_bytes": m.alias_bytes, "temp_bytes": m.temp_bytes,
                   "code_bytes": m.code_bytes, "peak_bytes": m.peak_bytes,
                   "needed_bytes": fit.needed_bytes, "hbm_share": fit.share,
                   "margin": 1 - fit.share})
  if hlo is not None:
    record.update({
        "matmul_flops_per_chip": hlo.matmul_flops, "kernel_flops_per_chip": hlo.kernel_flops,
        "flops_per_chip": hlo.flops, "analytic_flops_per_chip": p.analytic_flops,
        "compiler_over_analytic": hlo.flops / p.analytic_flops if p.analytic_flops else None,
        "compute_s": hlo.flops / chip.peak_flops_per_s,
        "hbm_s": hlo.hbm_bytes / chip.hbm_bytes_per_s,
        "kernels": [{"name": k.name, "count": k.count, "flops": k.flops,
                     "hbm_bytes": k.hbm_bytes} for k in hlo.kernels],
        "uncounted_custom_calls": dict(hlo.uncounted),
        "hbm_bytes_per_chip": hlo.hbm_bytes, "ici_bytes_per_chip": hlo.ici_bytes_per_chip,
        "unknown_trip_counts": hlo.unknown_trip_counts,
        "collectives_across_slices": p.collectives_across_slices,
        "megascale_transfers": p.megascale_transfers,
        "xla_cost_analysis_loops_once": p.cost_analysis,
        "collectives": [{"kind": c.kind, "axes": list(c.axes), "group_size": c.group_size,
                         "count": c.count, "bytes": c.bytes,
                         "ici_bytes_per_chip": c.ici_bytes_per_chip} for c in hlo.collectives]})
  return record


def _learner_record(report):
  target, chip, roof = report.target, report.chip, report.roofline
  record = {
      "learners": list(target.learners), "topology": target.topology, "chips": report.chips,
      "device_kind": target.device_kind,
      "mesh": dict(zip(target.mesh.axis_names, map(int, target.mesh.devices.shape))),
      "slice": target.slice.index if target.slice is not None else None,
      "slices_spanned": (len({slices.slice_key(d) for d in target.placed.devices.flat})
                         if target.placed is not None else None),
      "compiled_on": (sorted({slices.slice_key(d)[1] for d in target.mesh.devices.flat})
                      if target.placed is not None else None),
      "batch_size": report.batch_size, "seq_len": report.seq_len,
      "hbm_bytes": chip.hbm_bytes, "usable_hbm_bytes": chip.hbm_usable_bytes,
      "worst_program": report.worst.program,
      "worst_hbm_share": report.worst.fit.share if report.worst.fit.memory else None,
      "programs": [_program_record(p, chip) for p in report.programs],
  }
  if roof is not None:
    record["roofline"] = {
        "compute_s": roof.compute_s, "hbm_s": roof.hbm_s, "ici_s": roof.ici_s,
        "kernel_compute_s": roof.kernel_compute_s, "kernel_hbm_s": roof.kernel_hbm_s,
        "step_s": roof.step_s, "bound": roof.bound,
        "mfu_ceiling": roof.mfu_ceiling(chip.peak_flops_per_s),
        "mfu_ceiling_causal": roof.causal_mfu_ceiling(chip.peak_flops_per_s),
        "tokens_per_step": roof.tokens_per_step, "tokens_per_s_per_slice": roof.tokens_per_s,
        "peak_flops_per_s": chip.peak_flops_per_s, "hbm_bytes_per_s": chip.hbm_bytes_per_s,
        "ici_bytes_per_s": chip.ici_bytes_per_s}
  return record


def _syncer_record(load):
  t = load.timing
  return {
      "num_fragments": load.num_fragments, "period": load.period, "learners": load.learners,
      "clock_step_s": load.step_s, "merges_per_s": load.merges_per_s,
      "largest_fragment_params": max(load.fragment_params),
      "timed": {"fragment": t.fragment, "params": t.params, "learners": t.learners,
                "worker_s": t.worker_s, "worker_cpu_s": t.worker_cpu_s,
                "install_s": t.install_s, "bytes_up": t.bytes_up,
                "bytes_down": t.bytes_down},
      "largest_merge_s": load.largest_merge_s, "busy_worker_s_per_s": load.busy_s_per_s,
      "workers_needed": load.workers_needed,
      "largest_merge_within_period": load.keeps_each_fragment_fresh,
      "shards": [{"num_shards": s, "cores_per_shard": load.shard_cores(s),
                  "cores": sum(load.shard_cores(s))}
                 for s in _SHARD_COUNTS if s <= load.num_fragments],
      "timed_with": "fused merge (runtime/core/fused_merge.py)",
  }


def _kernel_lines(programs):
  """The kernels the analysis counted, per program, and the custom calls it could not count."""
  out = []
  for p in programs:
    kernels = [f"{k['name']} {k['count']} x: {k['flops'] / 1e12:.2f} TFLOP, "
               f"{_gib(k['hbm_bytes']):.2f} GiB" for k in p.get("kernels", [])]
    uncounted = [f"{name} {count} x" for name, count in
                 (p.get("uncounted_custom_calls") or {}).items()]
    if kernels or uncounted:
      out.append(f"- {p['program']}: " + "; ".join(kernels) + (
          ("; " if kernels else "") + "**not counted** (FLOPs unknown, bytes as operands and "
          "results): " + ", ".join(uncounted) if uncounted else ""))
  if not out:
    return []
  return ["", "Kernels (custom calls) per step, per chip, as runtime/hardware/kernels.py counts "
          "them:", ""] + out


def _failures(doc):
  """'learner(s) [0, 1] on v5e:2x2: train_step (HBM), ...' for every program that does not fit or
  compile, one entry per distinct learner; empty when all do."""
  failed = []
  for learner in doc["learners"]:
    names = []
    for p in learner["programs"]:
      if p["refused_by_compiler"] or p["compile_error"]:
        names.append(f"{p['program']} ({'HBM' if p['refused_by_compiler'] else 'does not compile'})")
      elif p.get("hbm_share", 0) > 1:  # compiles alone, not beside what the learner holds
        names.append(f"{p['program']} ({100 * p['hbm_share']:.0f}% of HBM)")
    if names:
      failed.append(f"learner(s) {learner['learners']} on {learner['topology']}: "
                    + ", ".join(names))
  return failed


def _markdown(doc):
  pod = doc.get("pod")
  out = [f"# Ahead-of-time TPU compile: {doc['experiment']}", "",
         *([f"A pod of {pod['num_slices']} slices of each of {', '.join(pod['topologies'])}, "
            "as one controller sees it (devices shuffled, each with its slice_index): every "
            "learner placed on its own slice by the run's carving (runtime/core/slices.py) and "
            "compiled for it (off slice 0 on slice 0's chips at the same positions: the "
            "compile-only pod compiles no program without slice 0).", ""] if pod else []),
         f"`{doc['command']}` on {doc['host']} ({doc['date']}), jax {doc['jax']}, libtpu "
         f"{doc['libtpu']}: {doc['wall_s']:.0f} s in all. model.remat={doc['remat']}"
         + (f" (auto, {doc['remat_s']:.0f} s: of the usable HBM per chip the train step needs "
            f"{doc['remat_tried']}; the train step's compile below was the last of these)"
            if doc.get("remat_tried") else "") + ".", ""]
  for learner in doc["learners"]:
    mesh = " x ".join(f"{k}={v}" for k, v in learner["mesh"].items())
    ids = learner["learners"]
    where = f" on slice {learner['slice']}" if learner.get("slice") is not None else ""
    out += [f"## Learner{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}{where}: "
            f"{learner['topology']} ({learner['chips']} x {learner['device_kind']}), {mesh}, "
            f"{learner['batch_size']} x {learner['seq_len']} tokens per step", ""]
    if learner.get("slice") is not None:
      kinds = sum(len(p.get("collectives", [])) for p in learner["programs"])
      across = sum(p.get("collectives_across_slices") or 0 for p in learner["programs"])
      transfers = sum(p.get("megascale_transfers") or 0 for p in learner["programs"])
      moved = (" (compiled on slice 0's chips at the same positions: the compile-only pod "
               "compiles no program without slice 0)" if learner["slice"] else "")
      out += [f"Its mesh spans {learner['slices_spanned']} slice(s){moved}; of its programs' "
              f"{kinds} collectives (kind x mesh axes), "
              + (f"**{across} join devices of two slices**" if across else
                 "none joins devices of two slices: all stay on the slice's ICI")
              + f"; cross-slice (megascale) transfers in the compiled programs: {transfers}.",
              ""]
    out += [
            f"HBM per chip: {_gib(learner['usable_hbm_bytes']):.2f} GiB usable of "
            f"{_gib(learner['hbm_bytes']):.0f} GiB; the most demanding program while training "
            f"({learner['worst_program']}) "
            + (f"leaves {100 * (1 - learner['worst_hbm_share']):.1f}% free."
               if learner["worst_hbm_share"] is not None else "does not fit or compile."), "",
            "| program | args / outputs (aliased) / temps / code, GiB per chip | + alongside | "
            "of usable HBM | TFLOP per chip (matmuls + kernels): compiler / lm/flops.py | "
            "compute / HBM ms at peak | ICI GiB sent per chip | compile s |",
            "|---|---|---|---|---|---|---|---|"]
    for p in learner["programs"]:
      name = p["program"] + (f" (x{p['count']})" if p["count"] > 1 else "")
      failure = p["refused_by_compiler"] or p["compile_error"]
      if failure:
        what = "HBM: " if p["refused_by_compiler"] else "does not compile: "
        out.append(f"| {name} | {what}{' '.join(failure.split())[:400]} | | | | | | "
                   f"{p['compile_s']:.1f} |")
        continue
      flops, times, ici = "-", "-", "-"  # no program (a broadcast applied by transfers only)
      if "flops_per_chip" in p:
        flops = f"{p['flops_per_chip'] / 1e12:.2f}"
        times = f"{p['compute_s'] * 1e3:.1f} / {p['hbm_s'] * 1e3:.1f}"
        ici = f"{_gib(p['ici_bytes_per_chip']):.2f}"
      if p.get("analytic_flops_per_chip"):
        flops += (f" / {p['analytic_flops_per_chip'] / 1e12:.2f} "
                  f"({p['compiler_over_analytic']:.3f}x)")
      out.append(
          f"| {name} | {_gib(p['argument_bytes']):.2f} / {_gib(p['output_bytes']):.2f} "
          f"({_gib(p['alias_bytes']):.2f}) / {_gib(p['temp_bytes']):.2f} / "
          f"{_gib(p['code_bytes']):.3f} | {_gib(p['alongside_bytes']):.2f} | "
          f"{100 * p['hbm_share']:.1f}% | {flops} | {times} | {ici} | {p['compile_s']:.1f} |")
    out += ["", "Collectives per step (count, buffer GiB, GiB each chip sends over ICI):", ""]
    for p in learner["programs"]:
      parts = [f"{c['kind']} over {'x'.join(c['axes']) or '-'} ({c['group_size']}): "
               f"{c['count']} x, {_gib(c['bytes']):.2f} GiB, {_gib(c['ici_bytes_per_chip']):.2f}"
               for c in p.get("collectives", [])]
      out.append(f"- {p['program']}: " + ("; ".join(parts) if parts else "none"))
    out += _kernel_lines(learner["programs"])
    unknown = sum(p.get("unknown_trip_counts") or 0 for p in learner["programs"])
    if unknown:
      out += ["", f"**{unknown} loop(s) of unknown trip count were counted once: the FLOPs, "
                  f"bytes and roofline above are lower bounds.**"]
    roof = learner.get("roofline")
    if roof:
      ici = f"{roof['ici_s'] * 1e3:.0f} ms" if roof["ici_s"] is not None else "n/a"
      out += ["", f"Roofline of the train step: compute {roof['compute_s'] * 1e3:.0f} ms, HBM "
              f"{roof['hbm_s'] * 1e3:.0f} ms"
              + (f" (the splash kernels' share: compute {roof['kernel_compute_s'] * 1e3:.0f} ms, "
                 f"HBM {roof['kernel_hbm_s'] * 1e3:.0f} ms)" if roof.get("kernel_compute_s") else "")
              + f", ICI {ici}: at least {roof['step_s'] * 1e3:.0f} ms "
              f"per step ({roof['bound']}-bound), an MFU ceiling of "
              f"{100 * roof['mfu_ceiling']:.1f}% ({100 * roof['mfu_ceiling_causal']:.1f}% without "
              "causal attention's masked half in the model FLOPs, as MaxText counts them) and at most "
              f"{roof['tokens_per_s_per_slice']:,.0f} tokens/s per slice."]
    out.append("")
  syncer = doc.get("syncer")
  if syncer:
    t = syncer["timed"]
    out += ["## Syncer", "",
            f"P = {syncer['num_fragments']}, H = {syncer['period']}, M = {syncer['learners']}; "
            f"at the fastest learner's roofline step of {syncer['clock_step_s'] * 1e3:.0f} ms, "
            f"{syncer['merges_per_s']:.2f} merges fall due per second. A merge of the median "
            f"fragment ({t['params'] / 1e6:.1f}M parameters, fragment {t['fragment']}) takes "
            f"{_gib(t['bytes_up']):.2f} GiB of outer gradients up and sends "
            f"{_gib(t['bytes_down']):.2f} GiB down; on this host it took {t['worker_cpu_s']:.1f} "
            f"CPU seconds ({t['worker_s']:.1f} s wall) on a worker (screen + merge) and "
            f"{t['install_s']:.3f} s to install. Scaled by parameters to all "
            f"{syncer['num_fragments']} fragments (the largest, "
            f"{syncer['largest_fragment_params'] / 1e6:.0f}M, {syncer['largest_merge_s']:.1f} s), "
            f"the merges need {syncer['busy_worker_s_per_s']:.1f} CPU seconds per second: "
            f"syncer.num_workers >= {syncer['workers_needed']}, one core each, at this host's "
            f"speed per core."]
    if "shards" in syncer:
      rows = "; ".join(
          f"{s['num_shards']} shard(s): {'+'.join(map(str, s['cores_per_shard']))} = "
          f"{s['cores']} cores" for s in syncer["shards"])
      fresh = ("within" if syncer["largest_merge_within_period"] else
               "longer than")
      out[-1] += (f" Sharded (config.syncer.num_shards, fragments balanced by bytes), the cores "
                  f"each shard needs: {rows}. The largest fragment's merge on one core is {fresh} "
                  f"its period of H steps ({syncer['period'] * syncer['clock_step_s']:.1f} s).")
    if "command" in syncer:
      out[-1] += (f" (This part timed again without compiling, {syncer['date']}, "
                  f"{syncer['host']}: `{syncer['command']}`.)")
    out.append("")
  return "\n".join(out)


def _report_name() -> str:
  """--name, or the config file's stem (`_multislice` added with --num_slices)."""
  return _NAME.value or pathlib.Path(sys.argv[[a.startswith("--config=") for a in sys.argv].index(
      True)].split("=", 1)[1]).stem + ("_multislice" if _NUM_SLICES.value else "")


def _timed_syncer(settings: settings_lib.RunSettings, steps: list[float]) -> dict:
  """The syncer's part of a report: a merge of the median fragment timed here, against the
  fastest of the learners' roofline `steps`."""
  print("timing a merge of the median fragment on this host ...", flush=True)
  timing = syncer_load.time_merge(settings, syncer_load.median_fragment(settings))
  return _syncer_record(syncer_load.load(settings, min(steps), timing))


def _write(base: str, doc: dict) -> None:
  os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
  with open(base + ".json", "w", encoding="utf-8") as f:
    json.dump(doc, f, indent=2)
  text = _markdown(doc)
  with open(base + ".md", "w", encoding="utf-8") as f:
    f.write(text + "\n")
  print(text)
  print(f"written: {base}.json, {base}.md")


def _retime_syncer(config) -> None:
  """--syncer_only: the syncer's part of an existing report, from a merge timed now."""
  base = os.path.join(_OUT_DIR.value, f"aot_{_report_name()}")
  if not os.path.isfile(base + ".json"):
    raise errors.InputError(f"--syncer_only: no report {base}.json to update; compile it first "
                            f"(without --syncer_only)")
  with open(base + ".json", encoding="utf-8") as f:
    doc = json.load(f)
  config.devices.platform = "tpu"
  config.devices.num_fake_cpu_devices = 0
  try:
    settings = settings_lib.validate(config)
  except ValueError as err:
    raise errors.InputError(f"Invalid config: {err}") from err
  steps = [l["roofline"]["step_s"] for l in doc["learners"] if l.get("roofline")]
  if settings.sync is None or not steps:
    raise errors.InputError(f"{base}.json has no learner roofline or the run no syncer: nothing "
                            f"to size")
  doc["syncer"] = _timed_syncer(settings, steps)
  doc["syncer"]["command"] = " ".join(["python scripts/aot_compile.py"] + sys.argv[1:])
  doc["syncer"]["date"] = datetime.date.today().isoformat()
  doc["syncer"]["host"] = f"{os.cpu_count()} CPU cores, {platform.machine()}"
  _write(base, doc)


def main(argv):
  if len(argv) > 1:
    raise errors.InputError(f"Unexpected arguments {argv[1:]}: flags take the form --name=value")
  started = time.perf_counter()
  path = config_flags.get_config_filename(flags.FLAGS["config"]) if _CONFIG.value is not None \
      else None
  if path is None or not os.path.isfile(path.split(":", 1)[0]):
    raise errors.InputError(f"--config={path or ''}: an experiment config file is required, e.g. "
                            f"--config=experiments/dense_5b_v5p.py")
  config = _CONFIG.value
  if _SYNCER_ONLY.value:
    _retime_syncer(config)
    return
  # Compiled for TPU chips: the run there places its own devices and donates the train state.
  config.devices.platform = "tpu"
  config.devices.num_fake_cpu_devices = 0
  if _TOPOLOGY.value:  # the topology of every learner, as the run would be configured for it
    config.devices.tpu_topologies = (_TOPOLOGY.value,)
  try:
    settings = settings_lib.validate(config)
    targets = tpu_aot.learner_targets(settings, _TOPOLOGY.value, _NUM_SLICES.value)
  except ValueError as err:
    raise errors.InputError(
        f"Invalid config: {err}",
        f"--topology={_TOPOLOGY.value} set config.devices.tpu_topologies" if _TOPOLOGY.value
        else "") from err
  configured_remat = settings.model.remat
  remat_tried = None
  remat_s = None
  if configured_remat == "auto":
    print("config.model.remat='auto': compiling the train step under each policy until one "
          "fits ...", flush=True)
    remat_started = time.perf_counter()
    settings, tried = tpu_aot.resolve_remat(settings, targets)
    remat_s = time.perf_counter() - remat_started
    remat_tried = ", ".join(
        f"{policy} {'/'.join(f'{100 * f.share:.0f}%' if f.memory else 'refused' for f in fits)}"
        for policy, fits in tried.items())
  reports = []
  for target in targets:
    where = f", {target.slice.name}" if target.slice is not None else ""
    print(f"compiling learner(s) {list(target.learners)} on {target.topology}{where} ...",
          flush=True)
    first = 0 in target.learners
    reports.append(tpu_aot.compile_learner(settings, target, with_eval=first,
                                           with_sampling=first or not _NUM_SLICES.value))
  name = _report_name()
  doc = {
      "experiment": name, "command": " ".join(["python scripts/aot_compile.py"] + sys.argv[1:]),
      "host": f"{os.cpu_count()} CPU cores, {platform.machine()}",
      "date": datetime.date.today().isoformat(),
      "jax": importlib.metadata.version("jax"), "libtpu": importlib.metadata.version("libtpu"),
      "remat": settings.model.remat if configured_remat != "auto" else
      f"auto -> {settings.model.remat}", "remat_tried": remat_tried, "remat_s": remat_s,
      "learners": [_learner_record(r) for r in reports],
  }
  if _NUM_SLICES.value:
    doc["pod"] = {"num_slices": _NUM_SLICES.value,
                  "topologies": sorted({t.topology for t in targets})}
  steps = [r.roofline.step_s for r in reports if r.roofline is not None]
  if _MERGE_TIMING.value and settings.sync is not None and steps:
    doc["syncer"] = _timed_syncer(settings, steps)
  doc["wall_s"] = time.perf_counter() - started
  _write(os.path.join(_OUT_DIR.value, f"aot_{name}"), doc)
  failed = _failures(doc)
  if failed:
    print(f"does not fit or compile: {'; '.join(failed)}", file=sys.stderr)
    sys.exit(EXIT_DOES_NOT_FIT)


if __name__ == "__main__":
  errors.run_main(main)
