"""Default experiment: Decoupled DiLoCo, 4 learners x 2 fake CPU devices, a ~0.28M-parameter byte-level
decoder on the bundled tiny-shakespeare corpus. Runs in a few minutes on a 2-core laptop or CI box.

  scripts/train.sh                                   # this config
  scripts/train.sh --config.num_steps=50 --config.sync.quorum=2

This file is where the defaults live: it sets every field the runtime has, each once, and the other
experiments start from it. `settings.validate` rejects a config that lacks a field or has one more.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # decoupled (the paper), diloco (lock-step, K = M, P = 1), streaming (lock-step with fragments),
  # dp (one synchronous data-parallel learner over all learner devices, batch num_learners x batch_size).
  config.mode = "decoupled"
  config.seed = 0  # model init (identical on every learner) and data order
  config.workdir = "workdir/tiny_cpu"  # metrics.jsonl, TensorBoard events, summary.json
  config.num_steps = 400  # inner steps per learner; tokens = num_steps x num_learners x batch x seq_len
  config.log_every = 25  # progress line every this many steps of the fastest learner
  config.eval_every = 100  # eval the global model (syncer's Theta) every this many steps; 0 = only at the end
  config.eval_batches = 8  # held-out batches (of data.batch_size x data.seq_len) per evaluation
  # Fail the run (every thread stopped, the error named) when no learner makes a step, or the final
  # flush does not end, for this many seconds: a hung run ends instead of waiting forever.
  config.stall_timeout_s = 600.0
  # A learner that fails (any error in its step path) is restarted as a new incarnation once its
  # devices are back, from a healthy peer's state and the syncer's Theta (decoupled and lock-step
  # modes); after this many restarts of one learner the run goes on without it. In dp mode the
  # whole job restarts from its newest checkpoint, at most this many times.
  config.max_restarts = 20
  # Learners held back at start (decoupled mode): each joins mid-run at its
  # join@learner=M,second=T event of chaos.schedule, through the rejoin path (a peer's state and the
  # syncer's Theta), as a scavenged slice would. E.g. (3,) with "join@learner=3,second=60".
  config.late_learners = ()

  # Faults to inject, see decoupled_diloco/chaos.py and docs/failures.md for
  # what each mode does with them (dp: the job restarts from its newest checkpoint). E.g.
  #   --config.chaos.schedule="crash@learner=1,step=100,down_s=5;hang@learner=2,step=50,seconds=3"
  # Injected today: crash, hang, slow, nan (its parameters go NaN; the learner fails on the next
  # non-finite loss and is restarted, and the syncer rejects the NaN offer it made meanwhile),
  # partition (its reports, pulls and broadcasts are lost for seconds=T; sync.heartbeat_timeout_s
  # finds it absent, and it is sent what it missed when it reports again), syncer_crash (restarted
  # from checkpoint.dir/syncer and the learners' newest Theta_p; decoupled mode only).
  # Random crashes: mtbf_s > 0 per learner, exponential; repairs Weibull with mean repair_s and
  # shape repair_shape (the goodput simulator's model).
  config.chaos = ml_collections.ConfigDict()
  config.chaos.schedule = ""  # faults at given steps/seconds, ";"-separated (chaos.py); "" = none
  config.chaos.mtbf_s = 0.0  # 0 = no random crashes
  config.chaos.repair_s = 5.0  # mean repair time of a random crash, seconds
  config.chaos.repair_shape = 0.85  # Weibull shape of the repair times
  config.chaos.seed = 0  # of the random crashes and repairs
  # runtime=ray on a cluster: the share of the random faults that are node losses (the learner's
  # whole host, every process on it) instead of process crashes; 0 = crashes only.
  config.chaos.node_loss_fraction = 0.0

  # Whole-job checkpoints (orbax, written asynchronously while the learners train): each learner's
  # train state, data position, counters and anchors, and the syncer's state, one consistent cut.
  # A run whose checkpoint.dir holds checkpoints of the same experiment resumes from the newest.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.every_steps = 100  # steps of the fastest learner between cuts; 0 = no checkpoints
  config.checkpoint.dir = ""  # "" = workdir/checkpoints; any path orbax takes (local, gs://...)
  config.checkpoint.keep = 3  # newest checkpoints kept (of the job, and of the syncer alone)
  # The syncer's state alone (Theta, outer states, versions), so a restarted syncer loses at most
  # this many seconds of outer momentum; 0 = never (decoupled mode only).
  config.checkpoint.syncer_every_s = 10.0
  # auto: resume from the newest checkpoint in checkpoint.dir if any | latest: resume, fail if
  # there is none | none: start afresh (checkpoint.dir must hold none) | PATH: that checkpoint.
  config.restore = "auto"
  # jax.profiler trace of learner 0's steps first..last (0-based, inclusive) into workdir/profile
  # (TensorBoard's profile plugin or Perfetto read it); () = no trace. E.g. (10, 12).
  config.profile_steps = ()
  # Persistent JAX compilation cache, so that a restarted or resumed run (or a rejoining learner
  # after a restart of the process) loads its compiled programs instead of compiling them again.
  # "" = workdir/jax_cache; "none" = the run sets none; or any directory.
  config.compilation_cache_dir = ""
  # Donate the train state to the learner's step (the step writes the new state over the old one,
  # so a learner holds one train state, not two): always | never | auto = on GPU and TPU, not on
  # CPU. On XLA:CPU donation buys no memory worth having and costs: with it the default run's
  # learners made 0.95x the tokens/s, its pulls came late more often and it discarded more progress
  # (goodput 88.2% against 91.2%; scripts/bench_donation.py, results/donation.json).
  config.donate_state = "auto"
  # The event tape, workdir/tape.jsonl: every merge (who took part, at which step, fingerprints of
  # the offers and of the new Theta_p), every merge a learner applied and every offer the syncer
  # took from it, in order, and the faults and checkpoints (runtime/records/event_tape.py).
  config.tape = True
  # "" = train | the workdir of a recorded run (config.tape=True): rerun its tape with no race,
  # bit for bit, with its recorded config (every field the command line does not set); with other
  # merge.*, outer.* or compression.* settings, a counterfactual replay on the same arrival pattern.
  config.replay = ""

  # threads: every learner a thread of this process | ray: every learner a process of its own, a
  # Ray actor (runtime/transport/ray_runtime.py; decoupled mode; crash, syncer_crash and corrupt_checkpoint
  # faults).
  config.runtime = "threads"
  config.ray = ml_collections.ConfigDict()
  # "" = a local Ray started by the command, on loopback only; "auto" or an address joins a cluster.
  config.ray.address = ""
  # runtime=ray: processes per learner, one per host of a multi-host slice (or GPU node), each
  # with its share of the learner's mesh; together one jax.distributed job that the framework
  # keeps in lock-step. A lost process takes its learner's others down with it, and the learner
  # rejoins as a whole. Must divide each learner's device count.
  config.ray.processes_per_learner = 1
  # runtime=ray on a cluster: the custom Ray resource each learner process (and the syncer) asks
  # one unit of, so they run on the hosts that advertise it (`ray start --resources='{"NAME": 1}'`);
  # a lost host's learner restarts on a spare that advertises it too. "" = any node with a CPU.
  config.ray.learner_resource = ""
  config.ray.syncer_resource = ""  # the same for the syncer's process (and its spare host)
  # runtime=ray on a cluster of TPU VMs: "" = off | a generation and topology ("v5p:2x2x2", a
  # v5p-16): each learner is one whole slice of it, claimed through Ray's slice head resource, with
  # one process per host (processes_per_learner is the slice's host count) in a jax.distributed
  # job of its own, MEGASCALE_* cleared; a slice that loses a host is left whole for a free one.
  config.ray.tpu_slice = ""

  config.devices = ml_collections.ConfigDict()
  config.devices.platform = "cpu"  # cpu | gpu | tpu: the platform whose devices the learners use
  # Fake host devices (XLA_FLAGS=--xla_force_host_platform_device_count), set before JAX starts;
  # 0 = use the real devices. 4 learners x 2 + 1 syncer device.
  config.devices.num_fake_cpu_devices = 9
  # Learners that share one set of devices (one GPU, one TPU host): consecutive groups of this
  # many train on the first learner's devices, each with its own state, thread and step, their
  # steps taking turns (decoupled_diloco/runtime/core/device_share.py). 1 = every learner on devices
  # of its own; num_learners = all on the same devices (experiments/one_gpu.py).
  config.devices.learners_sharing_devices = 1
  # GB of one learner device the run may fill (train states, publications, in-flight offers, the
  # step's working memory and the eval model), checked before anything is placed; 0 = what the
  # device reports (a GPU or TPU; a CPU reports nothing, so 0 leaves a CPU run unchecked).
  config.devices.memory_per_device_gb = 0.0
  # The TPU slice of each learner ("v5p:4x4x4"; one for all or one per learner), as the TPU
  # experiments name them: each learner is placed on a slice of that generation (a heterogeneous
  # run is matched by chip kind), and scripts/aot_compile.py compiles every learner program for it
  # on any host. () = none (CPU; any slice).
  config.devices.tpu_topologies = ()
  # Emulated slices: the fake CPU devices, by id, in runs of this many, each a "slice" as TPU
  # devices of one slice_index are. Every learner's mesh lies inside one slice (its all-reduce never
  # crosses two), so this tests the carving a multi-slice TPU run gets. 0 = none: the host's
  # devices are one group, learners take consecutive devices of it. CPU only.
  config.devices.fake_slice_size = 0
  # Pathways only (JAX_PLATFORMS=proxy): seconds between two checks whether a learner's lost
  # slice is back, each a small program on that slice (pathwaysutils' health check; its default
  # interval). The learner rejoins at the first check that finds it back. > 0.
  config.devices.slice_poll_s = 10.0

  config.num_learners = 4  # M: learners, each training on a mesh of its own
  # Mesh shape of each learner: one entry for all learners, or one per learner. (data, model), or
  # (data, fsdp, model) to shard weights and optimizer state over fsdp (a learner bigger than a
  # chip); the batch is split over data x fsdp.
  config.learner_mesh_shapes = ((2, 1),)
  # Extra seconds each learner sleeps per step (one entry per learner, or empty): emulates slower
  # hardware for heterogeneity studies. Empty = all learners run at the speed of their mesh.
  config.learner_step_delays_s = ()
  # Step-time noise for the same studies: after every step each learner also sleeps a number of
  # seconds drawn uniformly from [0, 2 x this) (mean this, std this / sqrt(3)), from its own
  # stream (seeded by config.seed and the learner). 0 = none.
  config.learner_step_noise_s = 0.0

  config.syncer = ml_collections.ConfigDict()
  # CPU devices of the syncer mesh; the learners' merge terms are sharded over them and summed by
  # one all-reduce. 1 here: on a 2-core box whose cores the learner threads keep busy, a syncer
  # program with a cross-device all-reduce waited ~0.5 s for its device threads to meet, against
  # ~5 ms on one device (measured 2026-11), and slow merges shut the grace window.
  config.syncer.num_devices = 1
  # Threads that merge different fragments at once (numpy and XLA release the GIL). 1 on a 2-core
  # box; on a GPU / TPU host with many cores, more keep large merges up with fast learner steps.
  config.syncer.num_workers = 1
  # Threads of one merge: its offers' screens and its tensors run as tasks on them, largest first
  # (numba's loops and XLA release the GIL); the values are bit for bit those of one thread. On a many-core syncer
  # host more shorten the largest fragment's merge (the tied embedding's), which more workers
  # cannot. Each worker's merge uses this many, so num_workers x merge_threads threads in all.
  config.syncer.merge_threads = 2
  # After a merge, the process's freed C heap (glibc's) goes back to the OS if the syncer last
  # looked this many seconds ago and the heaps hold at least 256 MB free: merges free arrays of a
  # fragment's size on several threads, and glibc kept them, the run's resident memory climbing
  # with the merges (runtime/core/host_heap.py).
  # Each trim costs the threads that allocate again (page faults): every 1 s slowed a 33.7M
  # data-parallel run 5-12%. 0 = never.
  config.syncer.heap_trim_every_s = 5.0
  # Each merge holds its worker until the fastest learner has made this many more steps: emulates
  # a syncer slower than the learners (the lagging regime), the same in steps on any host's load.
  # 0 = none (merges run at the host's speed); decoupled mode only.
  config.syncer.merge_delay_steps = 0
  # Shards of the syncer (the paper's "sharded M ways"): each owns some fragments, balanced by
  # bytes, with their Theta_p, outer states, merges and checkpoint, and runs as a thread on
  # num_devices CPU devices of its own (runtime=threads; raise devices.num_fake_cpu_devices by
  # num_devices per extra shard) or as a process of its own (runtime=ray, placed by
  # ray.syncer_resource). A lost shard is restored alone while the others merge on. Decoupled
  # mode only; at most sync.num_fragments. 1 here: one syncer thread keeps up with 4 tiny learners.
  config.syncer.num_shards = 1

  config.sync = ml_collections.ConfigDict()
  config.sync.num_fragments = 24  # P (paper: 24)
  config.sync.period = 24  # H: each fragment is merged every H inner steps, staggered (paper: 24)
  config.sync.overlap = 2  # tau: steps of compute the communication may overlap (paper: 2)
  config.sync.quorum = 1  # K: learners with a fresh fragment before a merge may start (paper: 1)
  # Grace window after quorum: clamp(gamma * (tau*xi_step - (xi_quorum + xi_sync)), 0, cap). gamma was
  # not published; 0.5 leaves half of the slack as margin so that no learner is ever blocked.
  config.sync.grace_gamma = 0.5
  config.sync.grace_cap_s = 1.0  # upper bound of the grace window, seconds
  config.sync.ema_decay = 0.9  # of the step / quorum / sync time estimates
  config.sync.fragmentation = "balanced"  # balanced | round_robin | layer_strided
  # Heartbeats: a learner whose step reports stop for longer than this is absent (hung, cut off by a
  # partition, dead without a word): not counted for the quorum, not waited for in a grace window,
  # its late offers get weight 0; its next report takes it back and the syncer sends it every
  # Theta_p newer than it holds. Not published. 0 = auto: 10 x that learner's step-time EMA, at
  # least 5 s (decoupled_diloco/algorithm/heartbeat.py says why); > 0 = seconds.
  config.sync.heartbeat_timeout_s = 0.0
  # diloco / streaming only: while a learner is down, the barrier drops it (each round merges the
  # learners present; it is taken back when it rejoins). False, the baselines as published: every
  # learner waits at the next barrier until the failed one is repaired and back.
  config.sync.elastic_lock_step = False

  config.merge = ml_collections.ConfigDict()
  config.merge.rule = "rda"  # rda | average (non-embedding tensors; the embedding is always averaged)
  config.merge.weighting = "tokens_sq_over_steps"  # tokens_sq_over_steps | tokens | uniform
  config.merge.anchor = "learner"  # learner (last Theta the learner received) | syncer (current Theta)
  config.merge.alpha = 0.0  # on receive: theta <- alpha*theta_local + (1-alpha)*Theta; 0 = overwrite
  # On receive, keep the steps a learner made after the offer the merge took in:
  # theta <- Theta + (theta_now - theta_offered). False = the paper's plain overwrite.
  config.merge.keep_in_flight_progress = False
  # Robust merge (algorithm/robust.py): the syncer rejects an outer gradient that is not finite, or
  # whose norm per unit of inner learning rate exceeds this many times the median of the last 32
  # such norms it accepted for that fragment (no outlier test until 4 were accepted; a window that
  # two learners outgrow together starts again). Not published. In the default run (2026-11-25,
  # inner rate 2e-2) no accepted norm exceeded 1.18x its fragment's window median up to merge 100 and
  # 2.0x after (1.26x / 1.74x at the old 3e-3), and no offer was rejected (judged per step rather
  # than per unit of rate: 24 rejected in the warmup, 11-190x). 10 rejects an update that blew up
  # by an order of magnitude. 0 = no outlier test; a non-finite outer gradient is rejected
  # whatever the value.
  config.merge.max_norm_ratio = 10.0

  config.outer = ml_collections.ConfigDict()
  config.outer.name = "sgd_nesterov"  # sgd_nesterov | sgd | adam
  # Not published for the paper; DiLoCo used 0.7 / 0.9. At this scale (200 steps, same seed)
  # momentum 0.9 ended at 2.17-2.20 nats/token, 0.6 at 2.01-2.03: merges of staggered fragments
  # with K = 1 are noisier than DiLoCo's lock-step averages and heavy momentum overshoots. 0.3
  # (with inner.learning_rate 2e-2): the quality study's choice on the validation split, see inner.
  config.outer.learning_rate = 0.7
  config.outer.momentum = 0.3  # Nesterov / heavy-ball momentum of the outer optimizer
  # N >= 2: Delayed Nesterov (arXiv 2401.09135, Algorithm 3), momentum folded in once every N merges
  # of a fragment and plain steps of lr/N between, sgd_nesterov only; 0 = off (as DiLoCo)
  config.outer.nesterov_delay = 0
  # Scale a stale offer's outer gradient by its staleness s (versions of Theta_p since its anchor):
  # none | inverse = 1/(1+s) (arXiv 1511.05950, lr/staleness) | inverse_sqrt = 1/sqrt(1+s)
  config.outer.staleness_scaling = "none"

  config.compression = ml_collections.ConfigDict()
  # learner -> syncer outer gradients: fp32 | bf16 | int8 | int4 | int2 (ternary) | int1 (sign x
  # mean|x|); the paper reports 2- and 1-bit collapse: offered to measure that
  config.compression.outer_grad = "bf16"
  config.compression.broadcast = "fp32"  # syncer -> learner Theta: fp32 | bf16
  # "none": each merge broadcasts the whole Theta_p. bf16 | int8 | int4 | int2 | int1: it broadcasts
  # Theta_p - R_p in that format, R_p being what the learners hold (one more copy of the parameters
  # on the syncer); a learner that missed one gets a keyframe of R_p (needs broadcast="fp32")
  config.compression.broadcast_delta = "none"
  config.compression.block_size = 64  # values per fp32 scale of the integer formats

  config.inner = ml_collections.ConfigDict()
  # AdamW peak. 2e-2 with outer.momentum 0.3 (3e-3 and 0.6 until 2026-11-25): the quality study
  # (scripts/study_quality.py) chose both on a validation split, and at 800 steps they beat the
  # old pair on validation and on eval for both seeds, at the same bytes and goodput
  # (docs/studies.md, "Quality gap to dp"). dp's own best learning rate there was 2e-2 as well.
  config.inner.learning_rate = 2e-2
  config.inner.warmup_steps = 40  # linear warmup of the inner rate, steps (< num_steps)
  config.inner.final_lr_fraction = 0.1  # cosine decays to learning_rate x this at num_steps
  config.inner.weight_decay = 0.01  # AdamW decoupled weight decay
  config.inner.b1 = 0.9  # AdamW first-moment decay
  config.inner.b2 = 0.99  # AdamW second-moment decay
  config.inner.eps = 1e-8  # AdamW epsilon
  config.inner.grad_clip_norm = 1.0  # 0 = no clipping

  config.model = ml_collections.ConfigDict()
  config.model.vocab_size = 0  # 0 = the tokenizer's (256 for bytes); larger pads the embedding
  config.model.embed_dim = 64  # width of the residual stream
  config.model.num_layers = 4  # transformer blocks
  config.model.num_heads = 4  # attention heads per block
  config.model.head_dim = 16  # width of one attention head
  config.model.mlp_dim = 256  # hidden width of the gated MLP
  config.model.max_seq_len = 128  # longest sequence the model takes (>= data.seq_len)
  config.model.dtype = "float32"  # activations; bfloat16 on TPU
  # float32 | bfloat16: the learners' weights, gradients and AdamW moments (the syncer's Theta and
  # outer state stay float32).
  config.model.param_dtype = "float32"
  config.model.rope_base = 10_000.0  # RoPE base frequency
  config.model.mlp_activation = "gelu"  # gelu (GeGLU, as in Gemma) | silu (SwiGLU, as in LLaMA)
  # Stack each kind of layer tensor on a leading axis and scan the blocks: start-up then does not
  # grow with depth (16 layers build in 1.07x the time of 4, against 2.6x unrolled). Off here: at 4
  # layers on CPU the unrolled step compiles and runs faster.
  config.model.scan_layers = False
  # xla | cudnn (flash attention on NVIDIA GPUs: bfloat16 only, devices.platform=gpu) | splash
  # (the Pallas flash attention kernel for TPU, devices.platform=tpu; data.seq_len and
  # model.max_seq_len multiples of 128). Compiled for TPUs, never run on one (docs/accelerators.md).
  config.model.attention = "xla"
  # The splash kernel's query / key block sizes: multiples of 128 that divide data.seq_len; 0 = the
  # default for the learner's TPU generation (1024 on v6e, 512 on the others: lm/splash.py).
  config.model.splash_block_q = 0
  config.model.splash_block_kv = 0  # the key / value block: as splash_block_q
  # Recompute block activations in the backward pass: none | full | a jax.checkpoint_policies name
  # (dots_saveable, dots_with_no_batch_dims_saveable, nothing_saveable, everything_saveable).
  config.model.remat = "none"

  config.data = ml_collections.ConfigDict()
  # A text file; a directory or glob of .txt / .jsonl / .parquet files; or a directory of ArrayRecord
  # shards made by scripts/prepare_data.py. "" = the bundled tiny-shakespeare corpus.
  config.data.source = ""
  # byte | a SentencePiece .model | a tokenizers .json file (scripts/train_tokenizer.py); "" = the
  # data's own: byte for text, the one in meta.json for ArrayRecord shards.
  config.data.tokenizer = ""
  config.data.text_field = "text"  # the text of a .jsonl line or .parquet row
  config.data.seq_len = 128  # tokens per training sequence (<= model.max_seq_len)
  config.data.batch_size = 16  # per learner (dp mode: num_learners x this, one learner)
  # One batch size per learner (sequences per step), or () = data.batch_size for every learner:
  # learners of different sizes, whose merges the token weights (merge.weighting) tell apart.
  # Decoupled and lock-step modes.
  config.data.learner_batch_sizes = ()
  # The last 5% of each text file's tokens is held out for evaluation (ArrayRecord shards: the
  # split prepare_data.py made, its --eval_fraction).
  config.data.eval_fraction = 0.05
  # The last this fraction of the training text (before the eval tail) is a validation split,
  # never trained on: evaluations also report the global model's loss on it (summary
  # final_validation_loss), so settings can be tuned without looking at the eval split. 0 = none.
  config.data.validation_fraction = 0.0
  return config
