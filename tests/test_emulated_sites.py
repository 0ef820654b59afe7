"""Learner hosts on emulated sites (scripts/emulated_sites.py): Ray nodes in network namespaces of
their own on this machine, joined to the head over links capped with htb; a partition made by the
network itself (a site's link down, then back); and a small case of scripts/bench_sites.py.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2). Every test acts
on events (a learner's step, the syncer seeing a learner absent), never on fixed sleeps."""

import ast
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest

from decoupled_diloco.runtime import train
from decoupled_diloco.runtime.transport import ray_runtime  # noqa: F401 (Ray's settings first)
from tests.conftest import act_when
from tests.conftest import load_script
from tests.conftest import tiny_settings
from tests.conftest import token_account_closes
from tests.conftest import wait_until

ray = pytest.importorskip("ray")
emulated_sites = load_script("emulated_sites")
bench_sites = load_script("bench_sites")

_UNAVAILABLE = emulated_sites.unavailable()
pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")]

_CACHE = {"dir": ""}


def _mine(prefix: str) -> list[str]:
  """Namespaces and links on this machine whose names start with `prefix`."""
  names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
  links = [line.split()[0] for line in subprocess.run(
      ["ip", "-br", "link"], capture_output=True, text=True).stdout.splitlines()]
  return [n for n in names + links if n.startswith(prefix)]


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
  """Three sites at 100 Mbit/s: two learner sites and the syncer's (bench_sites.SITES), the head
  in the root namespace, this process the driver beside it. Once the module is done, nothing of
  them is left on the machine."""
  _CACHE["dir"] = str(tmp_path_factory.mktemp("ray_jax_cache"))
  made = emulated_sites.Sites(len(bench_sites.SITES), 100, resources=bench_sites.SITES)
  with made:
    saved = {k: os.environ.get(k) for k in made.driver_env()}
    os.environ.update(made.driver_env())
    # Ray reads RAY_AUTH_MODE into its config once; as `ray.init` does for a local cluster
    # that turns token authentication on, it is read again (a driver started with the variable
    # set, as bench_sites' runs are, needs none of this).
    ray._raylet.Config.initialize("")  # pylint: disable=protected-access
    try:
      ray_runtime.start_ray(made.head_address, 0)
      yield made
    finally:
      ray.shutdown()
      for key, value in saved.items():
        if value is None:
          os.environ.pop(key, None)
        else:
          os.environ[key] = value
      ray._raylet.Config.initialize("")  # pylint: disable=protected-access
  assert _mine(made.prefix) == [] and not pathlib.Path("/etc/netns", made.prefix).exists()


def test_tear_down_removes_every_namespace_and_link_even_when_the_start_fails(monkeypatch):
  made = emulated_sites.Sites(2, 10)

  def fails():
    raise RuntimeError("the Ray node of site0 did not start")

  monkeypatch.setattr(made, "_start_ray", fails)
  with pytest.raises(RuntimeError, match="did not start"):
    with made:
      pass
  assert made.prefix.startswith("dds") and _mine(made.prefix) == []
  assert not any(pathlib.Path("/etc/netns").glob(f"{made.prefix}*"))
  assert not made.workdir.exists()


def test_each_site_is_a_ray_node_on_its_own_address_with_its_resource(sites):
  alive = {n["NodeManagerAddress"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
  assert set(alive) == {sites.gateway} | {s.address for s in sites.sites}
  for site in sites.sites:
    assert alive[site.address].get(site.resource) == 1
  assert "CPU" not in alive[sites.gateway]  # the head runs nothing: the driver sits beside it
  # Inside a site this machine's name is the site's address (jax.distributed's gloo binds to it).
  inside = subprocess.run(["ip", "netns", "exec", sites.sites[0].namespace, "getent", "hosts",
                           os.uname().nodename], capture_output=True, text=True).stdout
  assert inside.split()[0] == sites.sites[0].address


def test_the_counters_see_every_byte_between_two_sites_and_whose_it_is(sites):
  """1 MB from site 0 to site 1 over TCP: the interface counters and the htb class of that peer
  count it, payload to a few bytes (frame headers off); the class of the command's traffic does not."""
  receiver = subprocess.Popen(
      ["ip", "netns", "exec", sites.sites[1].namespace, sys.executable, "-c",
       "import socket, sys\ns = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1)\n"
       "print(s.getsockname()[1], flush=True)\nc, _ = s.accept()\n"
       "while c.recv(1 << 20): pass", sites.sites[1].address], stdout=subprocess.PIPE, text=True)
  port = int(receiver.stdout.readline())
  links, peers = sites.link_counters(), sites.peer_counters()
  subprocess.run(["ip", "netns", "exec", sites.sites[0].namespace, sys.executable, "-c",
                  "import socket, sys\nc = socket.create_connection((sys.argv[1], int(sys.argv[2])))"
                  "\nc.sendall(b'x' * 1_000_000); c.close()", sites.sites[1].address, str(port)],
                 check=True)
  receiver.wait(timeout=120)
  sent = sites.peer_counters()[0][1] - peers[0][1]
  got = sites.peer_counters()[1][0] - peers[1][0]
  # Other traffic of site 0 (its Ray node's heartbeats) goes to the head, in another class.
  # Off by a few bytes at most: the SYN carries 8 bytes of options more than a data segment's
  # timestamps, an ARP frame is 24 bytes short of a TCP header.
  assert sent.sent_payload == got.received_payload
  assert abs(sent.sent_payload - 1_000_000) <= 100
  assert (sites.link_counters()[0] - links[0]).sent_payload >= 1_000_000 - 100


def _records(workdir, kind):
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    return [r for r in map(json.loads, f) if r["kind"] == kind]


def _absent(workdir, learner):
  """The syncer's records (metrics.jsonl, written as they come) of `learner` found absent."""
  return [r for r in _records(workdir, "absent") if r["learner"] == learner]


def _site_of(sites, node_id: str) -> int:
  """The index of the site whose Ray node is `node_id`."""
  address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}[node_id]
  return next(s.index for s in sites.sites if s.address == address)


def test_a_partitioned_learner_trains_on_goes_absent_and_is_merged_again(sites, tmp_path):
  """Learner 1's site loses its link at the learner's step 4 (`ip link set ... down`), and gets
  it back once the syncer's heartbeats have seen the learner absent. No runtime code drops a
  message: the network does. Learner 1 trains on meanwhile; its step reports stop reaching the
  syncer; once the link is back its reports take it back and its offers are merged again, and
  the token account closes."""
  run = train.build(tiny_settings(
      tmp_path, runtime="ray", num_learners=2, num_steps=32, learner_mesh_shapes=((1, 1),),
      learner_step_delays_s=(0.3, 0.3), compilation_cache_dir=_CACHE["dir"],
      ray__address=sites.head_address, ray__learner_resource=bench_sites.LEARNER_SITE,
      ray__syncer_resource=bench_sites.SYNCER_SITE, sync__heartbeat_timeout_s=2.0))
  assert run.learners[1].nodes[0] != run.learners[0].nodes[0]
  site = _site_of(sites, run.learners[1].nodes[0])  # Ray places learners on either site
  cut = {}

  def partition():
    sites.cut(site)
    cut["at"] = time.monotonic()
    try:
      # Bounded well inside the 60 s after which a node cut off from the head's GCS ends itself.
      cut["absent_seen"] = wait_until(lambda: _absent(tmp_path, 1), timeout_s=30, poll_s=0.1)
    finally:
      cut["restored"] = time.monotonic()
      sites.restore(site)

  cutter = act_when(lambda: run.learners[1].step >= 4, partition)
  summary = train.execute(run, progress=False)
  cutter.join()
  assert cut["absent_seen"]
  assert any(cut["at"] < t < cut["restored"] for t in run.learners[1].step_ends)  # trained on
  absent = _absent(tmp_path, 1)[0]
  back = [r for r in _records(tmp_path, "back") if r["learner"] == 1][0]
  assert absent["silent_s"] >= 2.0 and back["step"] > absent["step"]
  merged_after = [d for d in run.syncer.tape if 1 in d["learners"]
                  and d["learner_steps"][d["learners"].index(1)] > back["step"]]
  assert merged_after  # merged again once back
  assert summary["faults"] == [] and summary["rejoins"] == 0  # the network cut it, nothing else
  assert summary["learner_steps"] == [32, 32] and summary["learner_errors"] == [None, None]
  assert summary["double_merged_offers"] == 0
  token_account_closes(summary)


def _in_this_process(tmp_path, num_steps):
  """bench_sites' `run`: an arm's overrides on the tests' tiny model, trained by this process."""

  def run(overrides):
    fields = {k.replace(".", "__"): _value(v) for k, v in overrides.items()
              if not k.startswith("model.") and k != "compilation_cache_dir"}
    fields.update(num_steps=num_steps, compilation_cache_dir=_CACHE["dir"])
    return train.execute(train.build(tiny_settings(tmp_path, **fields)), progress=False)

  return run


def _value(text):
  try:
    return ast.literal_eval(text) if isinstance(text, str) else text
  except (ValueError, SyntaxError):
    return text


def test_bench_sites_counts_a_decoupled_run_on_the_links(sites, tmp_path):
  """A small case of the benchmark: the decoupled arm at 100 Mbit/s, its bytes read from the
  links. The learners never talk to each other; every byte the syncer counts as taken crossed a
  learner's link, and not much more (a learner sending its whole model at every step would be
  several times more); the command's traffic is in a class of its own."""
  row = bench_sites.measure(sites, 100, "decoupled", _in_this_process(tmp_path, 16),
                            num_steps=16, batch=4)
  counters = row["counters"]
  assert counters["learner_to_learner"] == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  taken = summary["bytes_offers_taken"]
  assert summary["bytes_learner_to_syncer"] <= taken <= counters["learners_to_syncer"] < 1.5 * taken
  sent = summary["bytes_syncer_to_learners"]
  assert sent <= counters["syncer_to_learners"] < 1.5 * sent
  assert all(counters["with_command"][str(i)] > 0 for i in range(3))
  bench_sites.add_predictions([row])
  assert row["model_seconds_counted_bytes"] == pytest.approx(row["train_seconds"])  # calibrated
  assert row["tokens_per_s"] > 0 and math.isfinite(row["final_eval_loss"])
  assert any("learners_to_syncer" in line for line in bench_sites.checks([row]))
