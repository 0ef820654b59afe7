"""Start-up validation: every bad field fails before compilation, naming the field."""

import os

import pytest

from decoupled_diloco import settings
from decoupled_diloco.lm import data
from experiments import dp_baseline_cpu
from experiments import tiny_cpu


def _config(**fields):
  config = tiny_cpu.get_config()
  config.update_from_flattened_dict(fields)
  return config


def test_default_experiment_is_valid_and_resolves_to_the_spec_defaults():
  run = settings.validate(tiny_cpu.get_config())
  assert run.mode == "decoupled"
  assert run.num_learners == 4
  assert run.learner_mesh_shapes == ((2, 1),) * 4
  assert (run.sync.num_fragments, run.sync.period, run.sync.overlap, run.sync.quorum) == (
      24, 24, 2, 1)
  assert not run.sync.lock_step


@pytest.mark.parametrize("field,value,needle", [
    ("mode", "async", "config.mode='async'"),
    ("sync.quorum", 9, "config.sync.quorum=9"),
    ("sync.quorum", 0, "config.sync.quorum=0"),
    ("sync.period", 25, "config.sync.period"),  # H must be a multiple of P = 24
    ("sync.fragmentation", "random", "config.sync.fragmentation='random'"),
    ("sync.grace_gamma", 1.5, "config.sync.grace_gamma=1.5"),
    ("sync.heartbeat_timeout_s", -1.0, "config.sync.heartbeat_timeout_s=-1.0 is invalid: must be "
     "a number of seconds >= 0 (0 = auto"),
    ("sync.heartbeat_timeout_s", float("nan"), "config.sync.heartbeat_timeout_s=nan"),
    ("merge.rule", "median", "config.merge.rule='median'"),
    ("merge.weighting", "loss", "config.merge.weighting='loss'"),
    ("merge.anchor", "peer", "config.merge.anchor='peer'"),
    ("merge.alpha", 1.0, "config.merge.alpha=1.0"),
    ("merge.max_norm_ratio", -1.0, "config.merge.max_norm_ratio=-1.0"),
    ("merge.max_norm_ratio", float("nan"), "config.merge.max_norm_ratio=nan"),
    ("merge.alpha", float("nan"), "config.merge.alpha=nan"),
    ("outer.name", "lion", "config.outer.name"),
    ("outer.learning_rate", -1.0, "config.outer.learning_rate"),
    ("outer.nesterov_delay", -1, "config.outer.nesterov_delay=-1 is invalid: must be >= 0"),
    ("outer.nesterov_delay", 1, "config.outer.nesterov_delay=1 is invalid: must be 0 (off) or >= 2"),
    ("outer.staleness_scaling", "linear", "config.outer.staleness_scaling='linear' is invalid: "
     "must be one of none, inverse, inverse_sqrt"),
    ("compression.outer_grad", "int3", "config.compression.outer_grad='int3'"),
    ("compression.broadcast", "int4", "config.compression.broadcast='int4'"),
    ("compression.broadcast_delta", "int3", "config.compression.broadcast_delta='int3' is invalid: "
     "must be one of none, bf16, int8, int4, int2, int1"),
    ("inner.learning_rate", -3e-3, "config.inner.learning_rate"),
    ("model.num_heads", 0, "config.model.num_heads"),
    ("data.source", "/no/such/corpus.txt", "config.data.source='/no/such/corpus.txt'"),
    ("data.tokenizer", "/no/such/tokenizer.model", "config.data.tokenizer='/no/such/tokenizer"),
    ("data.tokenizer", "gpt2", "config.data.tokenizer='gpt2': unknown kind of tokenizer"),
    ("data.text_field", "", "config.data.text_field=''"),
    ("model.vocab_size", 200, "config.model.vocab_size=200 is invalid: must be >= the 256 ids"),
    ("data.seq_len", 4096, "config.data.seq_len=4096"),
    ("data.batch_size", 15, "config.data.batch_size=15"),  # does not split over data axis 2
    ("data.eval_fraction", 0.0, "config.data.eval_fraction=0.0"),
    ("learner_mesh_shapes", ((2, 1), (2, 1)), "config.learner_mesh_shapes"),
    ("learner_step_delays_s", (0.1,), "config.learner_step_delays_s"),
    ("learner_step_noise_s", -0.01, "config.learner_step_noise_s=-0.01"),
    ("num_steps", 0, "config.num_steps=0"),
    ("devices.platform", "ipu", "config.devices.platform='ipu'"),
    ("stall_timeout_s", 0.0, "config.stall_timeout_s=0.0"),
    ("syncer.num_workers", 0, "config.syncer.num_workers=0"),
    ("syncer.merge_threads", 0, "config.syncer.merge_threads=0 is invalid: must be >= 1"),
    ("syncer.heap_trim_every_s", -1.0,
     "config.syncer.heap_trim_every_s=-1.0 is invalid: must be in [0.0, inf]"),
    ("syncer.merge_delay_steps", -1, "config.syncer.merge_delay_steps=-1 is invalid: must be >= 0"),
    ("syncer.num_shards", 0, "config.syncer.num_shards=0 is invalid: must be >= 1"),
    ("syncer.num_shards", 25, "config.syncer.num_shards=25 is invalid: must be between 1 and "
     "config.sync.num_fragments=24: each shard owns at least one fragment"),
    ("model.attention", "flash", "config.model.attention='flash'"),
    ("donate_state", "yes", "config.donate_state='yes' is invalid: must be one of auto, always"),
    ("devices.tpu_topologies", ("v5p-8",), "entry 0 must be a topology name like 'v5p:4x4x4'"),
    ("devices.tpu_topologies", ("v4:2x2x1",), "generation one of v5p, v5e, v6e"),
    ("devices.tpu_topologies", ("v5p:2x2x1",), "v5p:2x2x1 has 4 chips but learner 0's mesh "
     "(config.learner_mesh_shapes) has 2 devices"),
    ("devices.tpu_topologies", ("v6e:1x2",) * 3, "one per learner (num_learners=4)"),
    ("devices.fake_slice_size", -1, "config.devices.fake_slice_size=-1 is invalid: must be >= 0"),
    ("model.remat", "auto", "config.model.remat='auto' is invalid: picks a policy from the TPU "
     "compiler's memory figures at start-up: it needs config.devices.platform='tpu'"),
    ("model.remat", "some", "config.model.remat='some' must be one of"),
])
def test_bad_field_fails_with_its_name(field, value, needle):
  _assert_fails(field, value, needle)


def test_only_the_decoupled_syncer_is_sharded_and_a_fault_names_a_shard_it_has():
  assert settings.validate(_config(**{"syncer.num_shards": 3})).syncer.num_shards == 3
  for mode in ("dp", "diloco", "streaming"):
    with pytest.raises(ValueError, match=rf"config\.syncer\.num_shards=2 is invalid: must be 1 "
                                         rf"with config\.mode='{mode}'"):
      settings.validate(_config(mode=mode, **{"syncer.num_shards": 2}))
  with pytest.raises(ValueError, match=r"shard=2 is out of range: config\.syncer\.num_shards=2"):
    settings.validate(_config(**{"syncer.num_shards": 2,
                                 "chaos.schedule": "syncer_crash@shard=2,second=1,down_s=1"}))


def test_fake_slices_are_for_fake_cpu_devices_only():
  assert settings.validate(_config(**{"devices.fake_slice_size": 2})).devices.fake_slice_size == 2
  with pytest.raises(ValueError, match=r"config\.devices\.fake_slice_size=2 is invalid: emulates "
                                       r"slices on fake CPU devices only"):
    settings.validate(_config(**{"devices.fake_slice_size": 2, "devices.platform": "tpu",
                                 "devices.num_fake_cpu_devices": 0}))


def test_nesterov_delay_needs_the_nesterov_outer_optimizer():
  config = _config(**{"outer.name": "adam", "outer.nesterov_delay": 4})
  with pytest.raises(ValueError, match=r"config\.outer\.nesterov_delay=4 is invalid: needs "
                     r"config\.outer\.name='sgd_nesterov' \(not 'adam'\)"):
    settings.validate(config)
  run = settings.validate(_config(**{"outer.nesterov_delay": 4,
                                     "outer.staleness_scaling": "inverse_sqrt"}))
  assert (run.outer.nesterov_delay, run.outer.staleness_scaling) == (4, "inverse_sqrt")


def test_merge_delay_is_for_the_decoupled_syncer_only():
  """Lock-step learners wait for each merge: a merge held for their next steps would never end."""
  assert settings.validate(_config(**{"syncer.merge_delay_steps": 3})).syncer.merge_delay_steps == 3
  with pytest.raises(ValueError, match=r"config\.syncer\.merge_delay_steps=3 is invalid: must be 0 "
                                       r"with config\.mode='streaming'"):
    settings.validate(_config(**{"syncer.merge_delay_steps": 3, "mode": "streaming"}))
  dp = settings.validate(_config(**{"syncer.merge_delay_steps": 3, "mode": "dp"}))
  assert dp.syncer.merge_delay_steps == 0  # no syncer


def test_the_renamed_data_path_says_its_new_name_and_why():
  config = tiny_cpu.get_config()
  config.data.path = "corpus.txt"
  with pytest.raises(ValueError, match=r"config\.data\.path was renamed to config\.data\.source: it "
                                       r"now takes .*ArrayRecord"):
    settings.validate(config)
  # A command-line override of a field the config lacks gets the same line (main.py).
  assert settings.unknown_field_error("data.path").startswith(
      "config.data.path was renamed to config.data.source")


def test_vocab_size_zero_is_the_tokenizers():
  assert settings.validate(tiny_cpu.get_config()).model.vocab_size == 256
  assert settings.validate(_config(**{"model.vocab_size": 512})).model.vocab_size == 512


def test_tpu_topologies_name_one_slice_per_learner_of_its_mesh_size():
  run = settings.validate(_config(**{"devices.tpu_topologies": ("v6e:1x2",)}))
  assert run.devices.tpu_topologies == ("v6e:1x2",) * 4
  run = settings.validate(_config(**{"devices.tpu_topologies": ("v6e:1x2", "v5p:2x1x1") * 2}))
  assert run.devices.tpu_topologies == ("v6e:1x2", "v5p:2x1x1") * 2
  # dp is one job over every learner's chips: no learner slice of its own.
  run = settings.validate(_config(**{"devices.tpu_topologies": ("v6e:1x2",), "mode": "dp"}))
  assert run.devices.tpu_topologies == ()


def test_remat_auto_is_a_tpu_threads_run_choice():
  config = _config(**{"model.remat": "auto", "devices.platform": "tpu"})
  assert settings.validate(config).model.remat == "auto"  # resolved at start-up, on the chips
  config.runtime = "ray"
  with pytest.raises(ValueError, match=r"config.model.remat='auto'.*config.runtime='threads'"):
    settings.validate(config)


def test_cudnn_attention_needs_gpu_devices():
  config = tiny_cpu.get_config()
  config.model.dtype = "bfloat16"
  config.model.attention = "cudnn"
  with pytest.raises(ValueError, match=r"config.model.attention='cudnn'.*platform='gpu'"):
    settings.validate(config)
  config.devices.platform = "gpu"
  settings.validate(config)


def test_splash_attention_needs_tpu_chips_and_sequences_in_whole_blocks():
  config = tiny_cpu.get_config()
  config.model.attention = "splash"
  with pytest.raises(ValueError) as refusal:
    settings.validate(config)
  # One line naming the field, the platform it runs on and what runs elsewhere.
  assert str(refusal.value) == (
      "config.model.attention='splash' is invalid: runs on TPU only "
      "(config.devices.platform='tpu', not 'cpu'): the Pallas splash kernel is built for TPU "
      "chips; use 'cudnn' on a GPU, 'xla' anywhere")
  config.devices.platform = "tpu"
  assert settings.validate(config).model.attention == "splash"
  config.model.splash_block_q = 256
  with pytest.raises(ValueError, match=r"config.model.splash_block_q=256 is invalid: must divide "
                                       r"config.data.seq_len=128"):
    settings.validate(config)
  config.model.splash_block_q = 0
  config.data.seq_len = 96
  with pytest.raises(ValueError, match=r"config.data.seq_len=96 is invalid: must be a multiple "
                                       r"of 128 with config.model.attention='splash'"):
    settings.validate(config)


def test_cudnn_attention_is_refused_for_learners_sharing_a_gpu_but_not_for_dp(monkeypatch):
  """Learners sharing a GPU that each ran cuDNN attention crashed the process on an H100; only
  scripts/gpu_triage.py's trial run (its environment variable) may try the pairing again."""
  config = tiny_cpu.get_config()
  config.update_from_flattened_dict({
      "model.dtype": "bfloat16", "model.attention": "cudnn", "devices.platform": "gpu",
      "devices.num_fake_cpu_devices": 0, "num_learners": 4, "learner_mesh_shapes": ((1, 1),),
      "devices.learners_sharing_devices": 4})
  with pytest.raises(ValueError, match=r"config.model.attention='cudnn'.*"
                                       r"learners_sharing_devices=4.*use 'xla'"):
    settings.validate(config)
  monkeypatch.setenv(settings.CUDNN_SHARING_TRIAL_ENV, "1")
  assert settings.validate(config).model.attention == "cudnn"
  monkeypatch.delenv(settings.CUDNN_SHARING_TRIAL_ENV)
  config.mode = "dp"  # one job on the device
  settings.validate(config)


def _assert_fails(field, value, needle):
  with pytest.raises(ValueError, match=None) as err:
    settings.validate(_config(**{field: value}))
  assert needle in str(err.value), str(err.value)


@pytest.mark.parametrize("value, platform, donates", [
    ("auto", "cpu", False), ("auto", "gpu", True), ("auto", "tpu", True),
    ("always", "cpu", True), ("never", "gpu", False)])
def test_donate_state_auto_donates_on_accelerators_only(value, platform, donates):
  # Validation reads no device: a gpu platform resolves on this CPU-only machine too.
  run = settings.validate(_config(donate_state=value, **{"devices.platform": platform}))
  assert run.donates_state is donates


def test_too_many_fragments_for_the_model_fails_at_start_up():
  with pytest.raises(ValueError, match="config.sync.num_fragments"):
    settings.validate(_config(**{"sync.num_fragments": 2000, "sync.period": 2000}))


def test_lock_step_modes_resolve_to_their_baselines():
  diloco = settings.validate(_config(mode="diloco"))
  assert (diloco.sync.num_fragments, diloco.sync.quorum, diloco.sync.overlap) == (1, 4, 0)
  assert diloco.sync.lock_step
  streaming = settings.validate(_config(mode="streaming"))
  assert (streaming.sync.num_fragments, streaming.sync.quorum) == (24, 4)
  assert streaming.sync.lock_step


def test_dp_is_one_learner_over_all_learner_devices_with_the_same_tokens_per_step():
  decoupled = settings.validate(tiny_cpu.get_config())
  dp = settings.validate(dp_baseline_cpu.get_config())
  assert dp.num_learners == 1 and dp.sync is None and dp.syncer.num_devices == 0
  assert dp.learner_devices == decoupled.learner_devices == 8
  assert dp.learner_batch_size == decoupled.num_learners * decoupled.learner_batch_size


def test_missing_field_is_named():
  config = tiny_cpu.get_config()
  del config.inner["final_lr_fraction"]
  with pytest.raises(ValueError, match=r"config\.inner\.final_lr_fraction is missing"):
    settings.validate(config)


@pytest.mark.parametrize("field, closest", [
    ("model.num_head", "config.model.num_heads"),
    ("sync.qorum", "config.sync.quorum"),
    ("lerning_rate", "config.inner.learning_rate"),
])
def test_unknown_field_is_named_with_the_closest_known(field, closest):
  config = tiny_cpu.get_config()
  config.unlock()
  section, _, name = field.rpartition(".")
  (config[section] if section else config)[name] = 1
  with pytest.raises(ValueError, match=rf"config\.{field} is not a config field") as err:
    settings.validate(config)
  assert closest in str(err.value), str(err.value)


def test_every_config_field_lands_at_its_dotted_path():
  """The tree covers the config one to one; only the fields `validate` resolves differ."""
  config = tiny_cpu.get_config()
  run = settings.validate(config)
  resolved = {
      "data.source": data.default_corpus_path(),  # "" = the bundled corpus
      "data.tokenizer": "byte",  # "" = the data's own: bytes for text
      "model.vocab_size": 256,  # 0 = the tokenizer's
      "learner_mesh_shapes": ((2, 1),) * 4,  # one entry stands for every learner
      "learner_step_delays_s": (0.0,) * 4,  # empty = no delay
      "checkpoint.dir": os.path.join(config.workdir, "checkpoints"),  # "" = under the workdir
      "profile_steps": None,  # () = no trace
      "compilation_cache_dir": os.path.join(config.workdir, "jax_cache"),  # "" = under the workdir
  }
  assert set(settings.config_fields()) == set(_flat(config))
  for field in settings.config_fields():
    node = run
    for part in field.split("."):
      node = getattr(node, part)
    expected = resolved.get(field, _flat(config)[field])
    assert node == expected, (field, node, expected)


def _flat(config, prefix=""):
  flat = {}
  for key, value in config.items():
    if hasattr(value, "items"):
      flat.update(_flat(value, f"{prefix}{key}."))
    else:
      flat[f"{prefix}{key}"] = value
  return flat


def test_model_fields_reach_the_model_config():
  run = settings.validate(_config(**{
      "model.embed_dim": 48, "model.num_heads": 2, "model.head_dim": 16, "model.mlp_dim": 96,
      "model.max_seq_len": 64, "model.dtype": "bfloat16", "model.rope_base": 500.0,
      "data.seq_len": 64}))
  assert (run.model.embed_dim, run.model.num_heads * run.model.head_dim) == (48, 32)
  assert (run.model.dtype, run.model.rope_base, run.model.max_seq_len) == ("bfloat16", 500.0, 64)


def test_workdir_under_a_file_is_named(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("", encoding="utf-8")
  with pytest.raises(ValueError, match=r"config\.workdir='.*a_file/run'.*is a file"):
    settings.validate(_config(workdir=str(blocker / "run")))


def test_remote_workdir_is_not_probed_on_this_host(monkeypatch):
  def probe(**kwargs):
    raise AssertionError(f"probed {kwargs['dir']} for a remote workdir")

  monkeypatch.setattr(settings.tempfile, "mkdtemp", probe)
  assert settings.validate(_config(workdir="gs://bucket/run")).workdir == "gs://bucket/run"
  with pytest.raises(AssertionError, match="probed"):
    settings.validate(_config(workdir="local/run"))


def test_dp_steps_at_the_pace_of_its_slowest_host():
  """dp is one synchronous job over every learner's devices: one slow host delays every step."""
  config = tiny_cpu.get_config()
  config.mode = "dp"
  config.learner_step_delays_s = (0.0, 0.0, 0.0, 0.25)
  assert settings.validate(config).learner_step_delays_s == (0.25,)


def test_the_delta_broadcast_is_validated_with_the_fields_it_depends_on():
  run = settings.validate(_config(**{"compression.broadcast_delta": "int4"}))
  assert run.compression.broadcast_delta == "int4"
  assert settings.validate(_config()).compression.broadcast_delta == "none"
  # Keyframes are the base later deltas add to: they must be exact.
  with pytest.raises(ValueError, match=r"config\.compression\.broadcast='bf16' is invalid: must be "
                                       r"'fp32' with config\.compression\.broadcast_delta='int4'"):
    settings.validate(_config(**{"compression.broadcast_delta": "int4",
                                 "compression.broadcast": "bf16"}))
  with pytest.raises(ValueError, match=r"config\.compression\.broadcast_delta='int2' is invalid: "
                                       r"runs with config\.runtime='threads' only"):
    settings.validate(_config(**{"compression.broadcast_delta": "int2", "runtime": "ray"}))


def test_the_ray_placement_resources_are_validated():
  run = settings.validate(_config(**{"runtime": "ray", "ray.learner_resource": "learner_host",
                                     "ray.syncer_resource": "syncer_host"}))
  assert (run.ray.learner_resource, run.ray.syncer_resource) == ("learner_host", "syncer_host")
  assert settings.validate(_config()).ray.learner_resource == ""
  with pytest.raises(ValueError, match=r"config\.ray\.learner_resource='learner_host' is invalid: "
                     r"places Ray actors: it needs config\.runtime='ray'"):
    settings.validate(_config(**{"ray.learner_resource": "learner_host"}))
  for bad in ("CPU", " host"):
    with pytest.raises(ValueError, match=r"config\.ray\.syncer_resource=.* is invalid: must be '' "
                       "or the name of a custom Ray resource"):
      settings.validate(_config(**{"runtime": "ray", "ray.syncer_resource": bad}))


def test_node_losses_need_ray_on_a_cluster():
  cluster = {"runtime": "ray", "ray.address": "auto"}
  run = settings.validate(_config(**cluster, **{"chaos.schedule": "node_loss@learner=1,step=3",
                                                "chaos.node_loss_fraction": 0.25,
                                                "chaos.mtbf_s": 30.0}))
  assert [f.kind for f in run.chaos.faults] == ["node_loss"]
  assert run.chaos.random_crashes.node_loss_fraction == 0.25
  for fields in ({"runtime": "ray"}, {}):
    with pytest.raises(ValueError, match=r"config\.chaos\.schedule='node_loss@syncer,second=2' is "
                       r"invalid: node losses need config\.runtime='ray' on a cluster"):
      settings.validate(_config(**fields, **{"chaos.schedule": "node_loss@syncer,second=2"}))
  with pytest.raises(ValueError, match=r"config\.chaos\.node_loss_fraction=0\.5 is invalid: node "
                     "losses need"):
    settings.validate(_config(**{"chaos.node_loss_fraction": 0.5, "chaos.mtbf_s": 30.0}))


def test_processes_per_learner_is_validated_with_the_runtime_and_the_meshes():
  assert settings.validate(_config()).ray.processes_per_learner == 1
  run = settings.validate(_config(**{"runtime": "ray", "ray.processes_per_learner": 2}))
  assert run.ray.processes_per_learner == 2
  with pytest.raises(ValueError, match=r"config\.ray\.processes_per_learner=2 is invalid: must be "
                                       r"1 unless config\.runtime='ray'"):
    settings.validate(_config(**{"ray.processes_per_learner": 2}))
  with pytest.raises(ValueError, match=r"config\.ray\.processes_per_learner=3 is invalid: must "
                                       r"divide every learner's device count"):
    settings.validate(_config(**{"runtime": "ray", "ray.processes_per_learner": 3}))
  with pytest.raises(ValueError, match=r"config\.ray\.processes_per_learner=0"):
    settings.validate(_config(**{"runtime": "ray", "ray.processes_per_learner": 0}))


_ON_V5P_16 = {"runtime": "ray", "ray.address": "auto", "ray.tpu_slice": "v5p:2x2x2",
              "learner_mesh_shapes": ((4, 2),)}


def test_a_tpu_slice_is_sized_by_ray_and_sets_the_processes_per_learner():
  assert settings.validate(_config()).ray.slice is None  # off by default
  run = settings.validate(_config(**_ON_V5P_16))
  shape = run.ray.slice
  assert (shape.pod_type, shape.hosts, shape.chips_per_host) == ("v5p-16", 2, 4)
  assert (shape.head_resource, shape.accelerator_type) == ("TPU-v5p-16-head", "TPU-V5P")
  assert run.ray.processes_per_learner == 2 and run.ray.tpu_slice == "v5p:2x2x2"
  assert settings.validate(_config(**_ON_V5P_16, **{"ray.processes_per_learner": 2})).ray.slice
  v5e = settings.validate(_config(**{**_ON_V5P_16, "ray.tpu_slice": "v5e:4x4",
                                     "learner_mesh_shapes": ((4, 4),)}))
  assert (v5e.ray.slice.pod_type, v5e.ray.processes_per_learner) == ("v5litepod-16", 4)


@pytest.mark.parametrize("fields,needle", [
    ({"ray.tpu_slice": "v5p-16"}, "config.ray.tpu_slice='v5p-16' is invalid: must be '' (off) or "
     "a TPU generation and topology like 'v5p:2x2x2'"),
    ({"ray.tpu_slice": "v5p:2x2x3"}, "config.ray.tpu_slice='v5p:2x2x3' is invalid: is not a TPU "
     "slice Ray's slice placement knows: 2x2x1, 2x2x2"),
    ({"ray.address": ""}, "config.ray.tpu_slice='v5p:2x2x2' is invalid: needs "
     "config.runtime='ray' on a cluster of TPU VMs"),
    ({"ray.processes_per_learner": 4}, "config.ray.processes_per_learner=4 is invalid: must be 2 "
     "(or 1, the default, which is read as 2): config.ray.tpu_slice='v5p:2x2x2' is a v5p-16 of 2 "
     "hosts"),
    ({"learner_mesh_shapes": ((2, 1),)}, "learner 0's mesh (2, 1) must have 8 devices, the chips "
     "of the v5p-16"),
    ({"ray.learner_resource": "learner_host"}, "config.ray.learner_resource='learner_host' is "
     "invalid: must be '' with config.ray.tpu_slice='v5p:2x2x2'"),
    ({"devices.tpu_topologies": ("v5p:2x4x4",)}, "config.devices.tpu_topologies=('v5p:2x4x4',"),
    ({"devices.platform": "gpu"}, "config.devices.platform='gpu' is invalid: must be 'tpu' with "
     "config.ray.tpu_slice"),
])
def test_a_bad_tpu_slice_is_refused_naming_the_field(fields, needle):
  with pytest.raises(ValueError) as raised:
    settings.validate(_config(**{**_ON_V5P_16, **fields}))
  assert needle in str(raised.value)


@pytest.mark.parametrize("fields,needle", [
    ({"devices.learners_sharing_devices": 0},
     "config.devices.learners_sharing_devices=0 is invalid: must be between 1 and "
     "config.num_learners=4"),
    ({"devices.learners_sharing_devices": 3},
     "config.devices.learners_sharing_devices=3 is invalid: must divide config.num_learners=4"),
    ({"devices.learners_sharing_devices": 2, "learner_mesh_shapes": ((1, 1), (2, 1), (2, 1),
                                                                     (2, 1))},
     "learners 0..1 share devices, so they need one mesh shape"),
    ({"devices.learners_sharing_devices": 2, "runtime": "ray", "ray.processes_per_learner": 2},
     "config.ray.processes_per_learner=2 is invalid: must be 1 with "
     "config.devices.learners_sharing_devices=2"),
    ({"devices.memory_per_device_gb": -1.0}, "config.devices.memory_per_device_gb=-1.0"),
])
def test_learners_sharing_devices_is_checked_naming_the_fields(fields, needle):
  with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
    settings.validate(_config(**fields))


def test_learners_that_share_devices_count_them_once_and_dp_spans_those():
  shared = settings.validate(_config(**{"devices.learners_sharing_devices": 4}))
  assert shared.learner_devices == 2 and shared.devices.learners_sharing_devices == 4
  dp = settings.validate(_config(mode="dp", **{"devices.learners_sharing_devices": 2}))
  # Four learners of (2, 1) in pairs: four distinct devices, one job over them, four batches.
  assert dp.learner_mesh_shapes == ((4, 1),) and dp.devices.learners_sharing_devices == 1
  assert dp.learner_batch_size == 4 * shared.learner_batch_size
