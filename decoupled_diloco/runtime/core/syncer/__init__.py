"""The syncer: one class in parts over the same state, on the syncer's own thread, and its shards.

  syncer.py      `Syncer`: set-up, the controller's calls, the inbox it reads, the clock
  rounds.py      rounds: a fragment falls due, offers are taken and land, quorum, grace, the flush
  merges.py      merges on worker threads: screen, merge and outer step, install, broadcast, record
  heartbeats.py  which learners are absent, and taking them back
  state.py       what a syncer checkpoint holds, the consistent cut, a restarted syncer
  merge_hold.py  config.syncer.merge_delay_steps: a merge held for that many learner steps
  sharded.py     config.syncer.num_shards: the shards read by the controller as one syncer
  load.py        what the syncer must do to keep up with learners of a given step time (AOT sizing)

Theta and the merge programs it runs are `core/global_model.py` and `core/fused_merge.py`; the
math is `algorithm/`. The runtimes around it: `control/syncer_keeper.py` and `shard_keeper.py`
(checkpoints, crashes, restarts), `transport/ray_syncer.py` (a syncer or shard as a Ray actor).
"""
