"""Learner programs compiled by the TPU compiler for real TPU topologies, on this CPU host
(runtime/tpu_aot.py): they fit, their FLOPs are the analytic count, and a learner too large for its
chip is refused with the numbers, as a TPU run refuses it at start-up."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from conftest import tiny_settings
from decoupled_diloco.lm import flops
from decoupled_diloco.lm import model
from decoupled_diloco.runtime.core import devices
from decoupled_diloco.runtime.hardware import hlo_analysis
from decoupled_diloco.runtime.hardware import memory_fit
from decoupled_diloco.runtime import tpu_aot
from decoupled_diloco.runtime import assembly

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The compiled matmul FLOPs of the tiny train step against lm/flops.py's count (measured: within
# 0.1%; see test_tiny_config_compiles_and_fits_on_two_tpu_topologies).
FLOPS_TOLERANCE = 0.02


def _tpu_settings(tmp_path, **overrides):
  """The tests' tiny config as a TPU run validates it: 4 learners, each on 2 x 2 chips, the
  blocks stacked and scanned as the TPU experiments run them."""
  fields = {"devices__platform": "tpu", "devices__num_fake_cpu_devices": 0,
            "learner_mesh_shapes": ((2, 2),), "model__scan_layers": True}
  return tiny_settings(tmp_path, **{**fields, **overrides})


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v6e:2x2"])
def test_tiny_config_compiles_and_fits_on_two_tpu_topologies(tmp_path, topology):
  settings = _tpu_settings(tmp_path)
  (target,) = tpu_aot.learner_targets(settings, topology)  # the 4 learners are alike
  assert target.learners == (0, 1, 2, 3) and target.mesh.devices.size == 4
  report = tpu_aot.compile_learner(settings, target)
  assert [p.program for p in report.programs] == [
      "train_step", "eval_step", "publication_copy", "broadcast_apply", "sampling_step"]
  usable = report.chip.hbm_usable_bytes
  for program in report.programs:
    assert program.fit.memory is not None, program.program
    assert 0 < program.fit.memory.peak_bytes and program.fit.needed_bytes < usable
    assert program.fit.fits_with_margin
  step = report.train_step
  # The run's donation: the new state is written into the old one's buffers.
  state = step.fit.alongside_bytes  # the publication's copy of the parameters ...
  assert step.fit.memory.alias_bytes > 2 * state  # ... and the state: them and the two moments
  # The compiler's matmuls are the analytic count (no remat: nothing recomputed), every loop
  # (the scanned blocks, forward and backward) at its trip count.
  assert step.hlo.unknown_trip_counts == 0
  assert step.hlo.matmul_flops == pytest.approx(step.analytic_flops, rel=FLOPS_TOLERANCE)
  per_chip = (flops.model_flops_per_token(settings.model, settings.data.seq_len)
              * settings.learner_batch_size * settings.data.seq_len / 4)
  assert step.analytic_flops == per_chip
  eval_step = report.programs[1]
  assert eval_step.hlo.matmul_flops == pytest.approx(eval_step.analytic_flops,
                                                     rel=FLOPS_TOLERANCE)
  # Data parallel over "data", tensor parallel over "model": gradients are summed over data.
  kinds = {(c.kind, c.axes) for c in step.hlo.collectives}
  assert any("data" in axes and kind in ("all-reduce", "reduce-scatter")
             for kind, axes in kinds), kinds
  assert report.roofline.step_s > 0 and 0 < report.roofline.mfu_ceiling(
      report.chip.peak_flops_per_s) <= 1


def test_loop_bodies_are_counted_at_their_trip_count():
  """XLA's cost_analysis counts a while loop's body once; the HLO walk counts it per trip."""
  mesh = Mesh(np.array(tpu_aot.topology_devices("v5p:2x2x1")).reshape(2, 2), ("a", "b"))
  x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))

  def layers(x, w):
    def body(carry, _):
      return jnp.tanh(carry @ w), None
    return jax.lax.scan(body, x, None, length=7)[0].sum()

  compiled = jax.jit(layers).lower(x, x).compile()
  stats = hlo_analysis.analyse(compiled.as_text(), mesh.axis_names, (2, 2))
  per_chip = 7 * 2 * 256**3 / 4
  assert stats.matmul_flops == per_chip
  assert compiled.cost_analysis()["flops"] < per_chip / 5
  assert stats.unknown_trip_counts == 0
  gathered = {(c.axes, c.count) for c in stats.collectives if c.kind == "all-gather"}
  assert gathered == {(("a",), 7), (("b",), 7)}


def test_hbm_bytes_of_a_loop_free_program_are_close_to_xla_s_own_count():
  """Without loops XLA's cost_analysis counts every instruction once too: the HLO walk's bytes,
  counted in every memory space, must land near its "bytes accessed" (measured 0.83 of it; XLA
  also counts the copy-done of each of the three 1 MiB asynchronous copies, which this walk takes
  for free). Only HBM's count: the compiler prefetched operands into VMEM (0.68 of XLA's)."""
  mesh = Mesh(np.array(tpu_aot.topology_devices("v5p:2x2x1")).reshape(2, 2), ("a", "b"))
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))

  def three_layers(x, w):
    for _ in range(3):
      x = jnp.tanh(x @ w)
    return x.sum()

  compiled = jax.jit(three_layers).lower(x, x).compile()
  text = compiled.as_text()
  everywhere = hlo_analysis.analyse(re.sub(r"S\(\d+\)", "", text), mesh.axis_names, (2, 2))
  assert everywhere.hbm_bytes == pytest.approx(compiled.cost_analysis()["bytes accessed"],
                                               rel=0.2)
  stats = hlo_analysis.analyse(text, mesh.axis_names, (2, 2))
  assert "S(1)" in text and stats.hbm_bytes < 0.9 * everywhere.hbm_bytes
  assert stats.matmul_flops == 3 * 2 * 1024**3 / 4


# XLA:TPU's prefetches into VMEM (memory space 1): a copy of a 4 KiB weight, a 1 KiB slice of a
# 4 KiB buffer, an eviction of 1 KiB back to HBM, an add whose operand is in VMEM; and a buffer
# allocated, which moves nothing.
_PREFETCHES = """
ENTRY %main (w: f32[1024], big: f32[1024]) -> f32[256] {
  %w = f32[1024]{0} parameter(0)
  %big = f32[1024]{0} parameter(1)
  %buffer = f32[4096]{0} custom-call(), custom_call_target="AllocateBuffer"
  %cs = (f32[1024]{0:S(1)}, f32[1024]{0}, u32[]{:S(2)}) copy-start(%w)
  %cd = f32[1024]{0:S(1)} copy-done(%cs)
  %ss = ((f32[1024]{0}), f32[256]{0:S(1)}, s32[]{:S(2)}) slice-start(%big), slice={[0:256]}
  %sd = f32[256]{0:S(1)} slice-done(%ss)
  %sum = f32[256]{0} add(%sd, %sd)
  %back = (f32[256]{0}, f32[256]{0:S(1)}, u32[]{:S(2)}) copy-start(%sd)
  ROOT %done = f32[256]{0} copy-done(%back)
}
"""


def test_prefetches_into_vmem_move_only_what_they_copy_and_vmem_reads_are_free():
  stats = hlo_analysis.analyse(_PREFETCHES, ("data",), (1,))
  # The weight read (4 KiB), the slice read (1 KiB), the add's result written (1 KiB; its operand
  # is in VMEM), the eviction written (1 KiB). Counted whole, it was 4 times that.
  assert stats.hbm_bytes == 4096 + 1024 + 1024 + 1024
  assert stats.uncounted == ()  # XLA's own custom call, known to compute and move nothing


# A counted loop as XLA:TPU writes its windowed einsums: the counter starts from a copied
# constant, is copied before it steps by 2 (bound 6: 3 trips), a dot of 2 x 8 x 8 x 8 FLOPs in
# the body.
_COUNTED_BY_TWO = """
%body (p: (s32[], f32[8,8])) -> (s32[], f32[8,8]) {
  %p = (s32[], f32[8,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8,8] get-tuple-element(%p), index=1
  %two = s32[] constant(2)
  %copied = s32[] copy(%i)
  %next = s32[] add(%copied, %two)
  %y = f32[8,8] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[8,8]) tuple(%next, %y)
}

%cond (q: (s32[], f32[8,8])) -> pred[] {
  %q = (s32[], f32[8,8]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[8,8]) -> f32[8,8] {
  %a = f32[8,8] parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8,8]) tuple(%start, %a)
  %w = (s32[], f32[8,8]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,8] get-tuple-element(%w), index=1
}
"""


def test_a_loop_counting_by_two_runs_half_its_bound():
  stats = hlo_analysis.analyse(_COUNTED_BY_TWO, ("data",), (1,))
  assert stats.matmul_flops == 3 * 2 * 8**3 and stats.unknown_trip_counts == 0
  # Read as a loop of step 1 it would have run 6 times; unreadable, it is counted once, flagged.
  unreadable = _COUNTED_BY_TWO.replace("%next = s32[] add(%copied, %two)",
                                       "%next = s32[] multiply(%copied, %two)")
  stats = hlo_analysis.analyse(unreadable, ("data",), (1,))
  assert stats.matmul_flops == 2 * 8**3 and stats.unknown_trip_counts == 1


def test_collectives_are_named_by_the_mesh_axes_they_span():
  """The compiler prints the program's mesh its own way: data x fsdp merged into one axis of 16
  here, axes of size 1 added. Every collective is named by our axes all the same."""
  text = """
ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024] parameter(0)
  %r = f32[1024] all-reduce(%a), replica_groups=mesh['axis_0'=16,'axis_1'=1,'axis_2'=4] {'axis_0','axis_1'}, to_apply=%add
  ROOT %g = f32[4096] all-gather(%r), replica_groups=[16,4]<=[64], dimensions={0}
}
"""
  stats = hlo_analysis.analyse(text, ("data", "fsdp", "model"), (2, 8, 4))
  by_kind = {c.kind: c for c in stats.collectives}
  assert by_kind["all-reduce"].axes == ("data", "fsdp") and by_kind["all-reduce"].group_size == 16
  assert by_kind["all-reduce"].ici_bytes_per_chip == 2 * 4096 * 15 / 16  # ring all-reduce
  assert by_kind["all-gather"].axes == ("model",) and by_kind["all-gather"].group_size == 4
  assert by_kind["all-gather"].ici_bytes_per_chip == 4 * 4096 * 3 / 4


# A causal splash forward kernel as XLA:TPU prints it (its metadata breaks the line), for 2 x 4
# sequences-heads of 1,024 tokens x 128 in blocks of 512; then a Pallas kernel nothing knows.
_SPLASH_HLO = """
HloModule m

ENTRY %main (q: bf16[2,4,1024,128], k: bf16[2,4,1024,128], v: bf16[2,4,1024,128]) -> f32[8] {
  %q = bf16[2,4,1024,128]{3,2,1,0} parameter(0)
  %k = bf16[2,4,1024,128]{3,2,1,0} parameter(1)
  %v = bf16[2,4,1024,128]{3,2,1,0} parameter(2)
  %mask = s8[1,2,2]{2,1,0} constant({ { { 1, 2 }, { 2, 1 } } })
  %fwd = (f32[2,512,128]{2,1,0}, bf16[2,4,1024,128]{3,2,1,0}) custom-call(%mask, %mask, %q, %k, %v), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\"block_q\": 512, \"block_kv\": 512, \"block_q_dkv\": 512, \"block_kv_dkv\": 512}"
}}, metadata={op_name="jit(f)/causal_splash_attention/vmap(static_sparsity_splash)/splash_mha_fwd_residuals/pallas_call"}
  %out = bf16[2,4,1024,128]{3,2,1,0} get-tuple-element(%fwd), index=1
  ROOT %mine = f32[8]{0} custom-call(%out), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/my_kernel/pallas_call"}
}
"""


def test_a_splash_kernel_is_counted_and_an_unknown_kernel_listed():
  stats = hlo_analysis.analyse(_SPLASH_HLO, ("data",), (1,))
  (kernel,) = stats.kernels
  # Causal, 2 x 2 blocks: the kernel visits 3 (the one above the diagonal skipped).
  assert kernel.name == "splash_mha_fwd" and kernel.count == 1
  assert kernel.flops == 4 * 8 * 1024 * 1024 * 128 * 3 / 4
  assert stats.matmul_flops == 0 and stats.flops == kernel.flops
  qkv = 8 * 1024 * 128 * 2
  once = 2 * 4 + 3 * qkv + (2 * 512 * 128 * 4 + qkv)  # operands, then results
  again = (3 / 2 - 1) * 2 * qkv  # K and V blocks read again for the second row of query blocks
  assert kernel.hbm_bytes == once + again
  # The kernel's second line did not end the computation: the custom call after it is seen,
  # and listed, not taken for nothing.
  assert stats.uncounted == (("my_kernel", 1),)
  full = hlo_analysis.analyse(_SPLASH_HLO.replace("causal_splash_attention/", ""), ("data",), (1,))
  assert full.kernels[0].flops == kernel.flops * 4 / 3  # another mask: every block


def test_a_tiny_splash_step_compiled_for_two_chips_counts_its_kernels(tmp_path):
  """The splash kernels' FLOPs and bytes enter the train step's roofline: without them XLA's
  count of the step would leave attention out, and lm/flops.py's count would not be met."""
  settings = _tpu_settings(tmp_path, num_learners=1, learner_mesh_shapes=((1, 2),),
                           model__attention="splash", model__max_seq_len=128, data__seq_len=128,
                           data__batch_size=2)
  (target,) = tpu_aot.learner_targets(settings, "v5p:2x2x1")
  report = tpu_aot.compile_learner(settings, target, with_eval=False, with_sampling=False)
  step = report.train_step
  assert {k.name for k in step.hlo.kernels} == {"splash_mha_fwd", "splash_mha_dkv_fused"}
  assert step.hlo.uncounted == ()
  assert report.roofline.kernel_compute_s > 0 and report.roofline.kernel_hbm_s > 0
  assert report.roofline.compute_s == pytest.approx(
      step.hlo.flops / report.chip.peak_flops_per_s)
  # One block of 128 tokens: the kernel computes it whole where lm/flops.py counts the causal half,
  # and its backward pass recomputes the scores (2.5x the forward, not 2x): measured 1.30x here,
  # where attention is 40% of the analytic count. Without the kernels it would be 0.78x.
  assert 0.95 <= step.hlo.flops / step.analytic_flops <= 1.5


def _eight_b(tmp_path, **overrides):
  """Gemma-7B's shape (8.5B parameters) on one v5e chip."""
  return tiny_settings(
      tmp_path, devices__platform="tpu", devices__num_fake_cpu_devices=0, num_learners=1,
      learner_mesh_shapes=((1, 1),), model__vocab_size=256_128, model__embed_dim=3072,
      model__num_layers=28, model__num_heads=16, model__head_dim=256, model__mlp_dim=24_576,
      model__scan_layers=True, model__dtype="bfloat16", data__batch_size=1, data__seq_len=32,
      sync__num_fragments=4, **overrides)


def test_an_8b_model_on_one_v5e_chip_is_refused_with_its_numbers(tmp_path):
  settings = _eight_b(tmp_path)
  mesh = tpu_aot.learner_targets(settings, "v5e:1x1")[0].mesh
  with pytest.raises(memory_fit.DoesNotFit) as refusal:
    assembly.check_learner_fits(settings, 0, mesh)
  message = str(refusal.value)
  # Parameters and both AdamW moments in float32: 12 bytes per parameter, on one chip.
  state_gib = 12 * model.num_params(model.param_shapes(settings.model)) / 1024**3
  assert "learner 0's train step" in message and "TPU v5 lite" in message
  assert "15.75 GiB" in message
  assert f"its train state and batch alone take {state_gib:.2f} GiB per chip" in message, message
  assert "config.learner_mesh_shapes[0]=(1, 1)" in message
  assert "config.model.remat" in message and "config.data.batch_size=1" in message


def test_cpu_runs_start_no_tpu_backend_even_with_libtpu_installed():
  """The platform the config names is the only accelerator backend a run starts: libtpu (the
  `tpu` extra) neither probes for chips nor prints its warnings in a CPU run."""
  code = ("from decoupled_diloco.runtime.core import devices; devices.use_platform('cpu'); "
          "import jax; jax.devices(); from jax._src import xla_bridge; "
          "print(sorted(xla_bridge._backends))")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120, check=True)
  assert out.stdout.strip().splitlines()[-1] == "['cpu']"
  assert "TPU" not in out.stderr, out.stderr


def _fit(share, usable=1000):
  """A compiled program that needs `share` of `usable` bytes (None: the compiler refused it)."""
  if share is None:
    return memory_fit.Fit(None, 0, usable, refusal="RESOURCE_EXHAUSTED: ... HBM")
  return memory_fit.Fit(memory_fit.ProgramMemory(int(share * usable), 0, 0, 0, 0), 0, usable)


def test_remat_auto_takes_the_first_policy_in_order_whose_every_learner_fits_with_margin():
  needs = {"none": [None, 0.5], "dots_saveable": [0.95, 0.5],
           "dots_with_no_batch_dims_saveable": [0.85, 0.91], "full": [0.6, 0.4]}
  policy, tried = memory_fit.choose_remat(lambda p: [_fit(s) for s in needs[p]])
  assert policy == "full"  # dots_with_no_batch_dims_saveable leaves one learner only 9% free
  assert list(tried) == list(memory_fit.REMAT_ORDER)
  policy, tried = memory_fit.choose_remat(lambda p: [_fit(0.2)])
  assert policy == "none" and list(tried) == ["none"]  # nothing is compiled beyond the first fit
  with pytest.raises(memory_fit.DoesNotFit, match=r"with 'full' the largest learner step needs "
                                                   r"0\.00 GiB of 0\.00 GiB"):
    memory_fit.choose_remat(lambda p: [_fit(0.95)])


@pytest.mark.slow  # the compiles of the policies that fit take minutes on 2 cores
def test_remat_auto_resolves_on_the_chips_from_the_compiled_steps(tmp_path):
  """A learner whose activations do not fit one v5e chip without remat: start-up (and
  aot_compile.py) picks the first policy that leaves 10% of HBM free, from the compiler's figures."""
  settings = _tpu_settings(
      tmp_path, num_learners=1, learner_mesh_shapes=((1, 1),), model__remat="auto",
      model__embed_dim=512, model__num_heads=4, model__head_dim=128, model__mlp_dim=2048,
      model__max_seq_len=512, data__seq_len=512, data__batch_size=512, model__dtype="bfloat16")
  targets = tpu_aot.learner_targets(settings, "v5e:1x1")
  resolved, tried = tpu_aot.resolve_remat(settings, targets)
  policy = resolved.model.remat
  assert policy != "none" and tried[policy][0].fits_with_margin
  assert all(not fits[0].fits_with_margin for p, fits in tried.items() if p != policy)
  assert list(tried) == list(memory_fit.REMAT_ORDER[:memory_fit.REMAT_ORDER.index(policy) + 1])


def test_a_two_slice_pod_compiles_every_learner_inside_its_own_slice(tmp_path):
  """scripts/aot_compile.py --num_slices=2 in small: the run's carving places each learner on a
  slice of a real 2-slice topology, and no compiled program of either joins two slices. The same
  check on a mesh carved across the two slices finds what the compiler sends between them."""
  settings = _tpu_settings(tmp_path, num_learners=2)
  targets = tpu_aot.learner_targets(settings, "v5p:2x2x1", num_slices=2)
  assert [(t.learners, t.slice.index) for t in targets] == [((0,), 0), ((1,), 1)]
  for target in targets:
    assert {d.slice_index for d in target.placed.devices.flat} == {target.slice.index}
    report = tpu_aot.compile_learner(settings, target, with_eval=False, with_sampling=False)
    step = report.train_step
    assert any("data" in c.axes and c.kind in ("all-reduce", "reduce-scatter")
               for c in step.hlo.collectives), step.hlo.collectives
    for program in report.programs:
      assert not program.error, program.error
      assert (program.collectives_across_slices, program.megascale_transfers) == (0, 0), program
  pod = tpu_aot.topology_devices("v5p:2x2x1", num_slices=2)
  across = ([d for d in pod if d.slice_index == 0][:2]
            + [d for d in pod if d.slice_index == 1][:2])  # data axis over the two slices
  mesh = devices.learner_mesh(across, (2, 2))
  report = tpu_aot.compile_learner(settings, tpu_aot.LearnerTarget((0,), "v5p:2x2x1", mesh, None,
                                                                   mesh),
                                   with_eval=False, with_sampling=False)
  step = report.train_step
  assert step.collectives_across_slices + step.megascale_transfers > 0



@pytest.mark.slow  # 10-20 s: a Gemma-2B-shaped step compiled until the compiler refuses it
def test_aot_compile_exits_3_naming_the_programs_that_do_not_fit(tmp_path):
  """scripts/aot_compile.py as a gate: Gemma 2B replicated on 4 v5e chips does not fit, and the
  command says so in one line and exits 3. --topology replaces the experiment's own topologies
  before validation (v5p:4x4x4 has 64 chips, this mesh 4)."""
  command = [sys.executable, "scripts/aot_compile.py", "--config=experiments/gemma_2b_v5p.py",
             "--topology=v5e:2x2", "--config.learner_mesh_shapes=((4, 1),)",
             "--config.data.batch_size=4", f"--out_dir={tmp_path}", "--merge_timing=false"]
  out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       check=False)
  assert out.returncode == 3, out.stderr[-2000:]
  summary = out.stderr.strip().splitlines()[-1]
  assert summary.startswith("does not fit or compile: learner(s) [0, 1, 2, 3, 4, 5, 6, 7] on "
                            "v5e:2x2: train_step (HBM), eval_step (HBM)"), summary
  assert (tmp_path / "aot_gemma_2b_v5p.md").exists()  # the report is written all the same
