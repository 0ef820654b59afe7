r"""Emulated sites on this machine: Ray hosts in network namespaces of their own, over capped links.

  sudo .venv/bin/python scripts/emulated_sites.py --sites=learner_host,learner_host,syncer_host \
      --rate_mbit=100 -- scripts/train.sh --config.runtime=ray --config.ray.address=HEAD \
      --config.ray.learner_resource=learner_host --config.ray.syncer_resource=syncer_host

builds the sites, runs the command beside the head (HEAD in it is replaced by the head's address)
and takes everything down when it ends; without a command it holds the sites until Ctrl-C.

A *site* is a network namespace with a private address of its own, joined to the root namespace by
a veth pair on a bridge (the root namespace holds the bridge's `.1` address). Both ends of the pair
are capped with tbf at the site's rate: the end inside the site shapes what the site sends, the end
on the bridge what it receives, so the link is symmetric and every byte between two sites crosses
two capped links, as between two datacenters. A Ray node runs inside each site (`ray start` under
`ip netns exec`, bound to the site's address, carrying the site's custom resource); the head runs
in the root namespace on the bridge's address with no CPU, so nothing is placed on it and the
command that drives a run (its driver) sits beside it. The counters of the bridge-side end are the
site's link: what it received there is what the site sent (`link_counters`).

Nothing leaves this machine: the addresses are a 10.x.y.0/24 that no interface here has, the bridge
has no route beyond itself and nothing forwards or masquerades. Names carry a random prefix, so
sites of two runs (or two engineers) never meet, and tear-down (`close`, run on every way out of a
`with Sites(...)` block, a failed start included) kills every process inside the namespaces and the
head's, and removes the namespaces, veths, bridge and files it made.

Each site's /etc/hosts (`/etc/netns/<namespace>/hosts`, which `ip netns exec` mounts over
/etc/hosts) names this machine's hostname with the site's address, as a host of its own resolves
its name: gloo, jax.distributed's CPU collectives, binds to the address of the hostname, and the
machine's own 127.0.0.1 would be out of reach from the other sites.

Ray's token authentication is on (RAY_AUTH_MODE=token, the token file ~/.ray/auth_token on every
node and the driver alike: one machine). RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is removed from the
nodes' environment: the Ray runtime sets it to 0 for a local Ray, and a worker node given 0
refuses to join a cluster of several nodes.

No netem on this kernel: links have no added delay. Needs root, `ip` and `tc` (`unavailable`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

RAY = str(pathlib.Path(sys.executable).with_name("ray"))
# The bytes a TCP segment adds on the wire, counted by the interfaces: Ethernet 14, IPv4 20, TCP 20
# and 12 of timestamps. A test of 10 MB sent over one connection here: 66.0 bytes a frame, with
# MTU 1500 and 9000 alike (the stack hands large segments down whole, so frames are fewer).
FRAME_OVERHEAD_BYTES = 66
_STARTED = "Ray runtime started."  # what `ray start` prints once its node is registered
_START_TIMEOUT_S = 300.0  # a node's start on a loaded 2-core host (it imports Ray, starts daemons)


def unavailable() -> str | None:
  """Why sites cannot be made here, in one line; None where they can."""
  if os.geteuid() != 0:
    return "emulated sites need root (network namespaces, veth, tc)"
  for tool in ("ip", "tc"):
    if shutil.which(tool) is None:
      return f"emulated sites need `{tool}` (iproute2), not found"
  name = f"dds{secrets.token_hex(3)}probe"
  made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
  if made.returncode != 0:
    return f"`ip netns add` failed here: {made.stderr.strip()}"
  subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
  return None


@dataclasses.dataclass(frozen=True)
class Site:
  """One site: its namespace, address, the two ends of its link and its Ray resource."""

  index: int
  namespace: str
  address: str
  host_link: str  # the veth end on the bridge, in the root namespace: the site's link counters
  site_link: str  # the end inside the site
  resource: str  # the custom Ray resource its node carries ("" = none)


@dataclasses.dataclass(frozen=True)
class LinkCounters:
  """A site's link as its interface counts it: bytes and frames the site sent and received."""

  sent_bytes: int
  received_bytes: int
  sent_frames: int
  received_frames: int

  def __sub__(self, other: "LinkCounters") -> "LinkCounters":
    return LinkCounters(*(a - b for a, b in zip(dataclasses.astuple(self),
                                                dataclasses.astuple(other))))

  @property
  def sent_payload(self) -> int:
    """TCP payload the site sent: bytes less every frame's headers (FRAME_OVERHEAD_BYTES)."""
    return self.sent_bytes - FRAME_OVERHEAD_BYTES * self.sent_frames

  @property
  def received_payload(self) -> int:
    return self.received_bytes - FRAME_OVERHEAD_BYTES * self.received_frames


def _run(*args: str) -> str:
  done = subprocess.run(list(args), capture_output=True, text=True, check=False)
  if done.returncode != 0:
    raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.strip()}")
  return done.stdout


def _free_subnet() -> ipaddress.IPv4Network:
  """A 10.x.y.0/24 that no interface of this machine has an address in (nor another run's)."""
  taken = [ipaddress.ip_interface(a["local"] + "/" + str(a["prefixlen"])).network
           for link in json.loads(_run("ip", "-j", "-4", "addr"))
           for a in link.get("addr_info", [])]
  for _ in range(200):
    net = ipaddress.ip_network(f"10.{200 + secrets.randbelow(55)}.{secrets.randbelow(256)}.0/24")
    if not any(net.overlaps(t) for t in taken):
      return net
  raise RuntimeError("no free 10.x.y.0/24 for the sites")


_OTHERS = 99  # the htb class of a link's traffic with anything but another site: the head, the command
_CLASS = re.compile(r"class htb 1:(\w+) .*?\n\s*Sent (\d+) bytes (\d+) pkt", re.S)


def _htb(rate_mbit: float, burst: bool = False) -> list[str]:
  """htb rate arguments at `rate_mbit`, with a bucket of 4 ms at the rate (at least 64 KiB, so a
  large segment passes whole) where `burst`."""
  args = ["rate", f"{rate_mbit}mbit"]
  if burst:
    size = str(max(65536, int(rate_mbit * 1e6 / 8 * 0.004)))
    args += ["burst", size, "cburst", size]
  return args


class Sites:
  """N emulated sites and a Ray cluster over them (see the module docstring); a context manager.

  `resources[i]` is the custom Ray resource site i's node carries ("" for none, the default
  `site{i}`); `num_cpus` its node's CPUs. `ray=False` builds the network only.
  """

  def __init__(self, count: int, rate_mbit: float, *, resources: Sequence[str] | None = None,
               num_cpus: int = 1, ray: bool = True, system_config: dict | None = None):
    if count < 1:
      raise ValueError(f"count={count} must be >= 1")
    self.prefix = f"dds{secrets.token_hex(3)}"
    self.rate_mbit = rate_mbit
    self._resources = list(resources) if resources is not None else [f"site{i}"
                                                                     for i in range(count)]
    if len(self._resources) != count:
      raise ValueError(f"resources={self._resources} must name one per site ({count})")
    self._count, self._num_cpus, self._ray = count, num_cpus, ray
    self._system_config = system_config
    self.bridge = f"{self.prefix}br"
    self.sites: list[Site] = []
    self.head_address = ""  # "ip:port" of the head's GCS once started
    self.workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"{self.prefix}_", dir="/tmp"))
    self._head: subprocess.Popen | None = None
    self._nodes: list[subprocess.Popen] = []
    self._hosts_dirs: list[pathlib.Path] = []

  # ---- building ---------------------------------------------------------------------------------

  def __enter__(self) -> "Sites":
    try:
      self._build_network()
      if self._ray:
        self._start_ray()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _build_network(self) -> None:
    net = _free_subnet()
    hosts = list(net.hosts())
    gateway = hosts[0]
    _run("ip", "link", "add", self.bridge, "type", "bridge")
    _run("ip", "addr", "add", f"{gateway}/{net.prefixlen}", "dev", self.bridge)
    _run("ip", "link", "set", self.bridge, "up")
    self.gateway = str(gateway)
    for i in range(self._count):
      site = Site(i, f"{self.prefix}-{i}", str(hosts[1 + i]), f"{self.prefix}h{i}",
                  f"{self.prefix}n{i}", self._resources[i])
      self.sites.append(site)
      self._add_site(site, net.prefixlen)
    for site in self.sites:  # each link's classes name every other site
      self._shape(site)

  def _add_site(self, site: Site, prefixlen: int) -> None:
    _run("ip", "netns", "add", site.namespace)
    _run("ip", "link", "add", site.host_link, "type", "veth", "peer", "name", site.site_link)
    _run("ip", "link", "set", site.site_link, "netns", site.namespace)
    _run("ip", "link", "set", site.host_link, "master", self.bridge)
    _run("ip", "link", "set", site.host_link, "up")
    inside = ("ip", "netns", "exec", site.namespace)
    _run(*inside, "ip", "addr", "add", f"{site.address}/{prefixlen}", "dev", site.site_link)
    _run(*inside, "ip", "link", "set", site.site_link, "up")
    _run(*inside, "ip", "link", "set", "lo", "up")
    hosts_dir = pathlib.Path("/etc/netns") / site.namespace
    hosts_dir.mkdir(parents=True, exist_ok=True)
    self._hosts_dirs.append(hosts_dir)
    (hosts_dir / "hosts").write_text(f"127.0.0.1 localhost\n{site.address} {socket.gethostname()}\n")

  def _shape(self, site: Site) -> None:
    """Caps both ends of the site's link at the rate with htb: one class for the whole link, under
    it one per other site (matched by its address) and one for the rest, so that the kernel's
    class counters split the link's bytes by peer (`peer_counters`)."""
    others = [s for s in self.sites if s is not site]
    for end, inside, match in ((site.site_link, True, "dst"), (site.host_link, False, "src")):
      tc = ["ip", "netns", "exec", site.namespace, "tc"] if inside else ["tc"]
      subprocess.run([*tc, "qdisc", "del", "dev", end, "root"], capture_output=True, check=False)
      _run(*tc, "qdisc", "add", "dev", end, "root", "handle", "1:", "htb", "default",
           str(_OTHERS))
      _run(*tc, "class", "add", "dev", end, "parent", "1:", "classid", "1:1", "htb",
           *_htb(self.rate_mbit, burst=True))
      share = self.rate_mbit / (len(others) + 1)
      for peer in [*others, None]:
        classid = f"1:{_OTHERS if peer is None else 10 + peer.index}"
        _run(*tc, "class", "add", "dev", end, "parent", "1:1", "classid", classid, "htb",
             *_htb(share), "ceil", f"{self.rate_mbit}mbit", *_htb(self.rate_mbit, True)[2:])
        if peer is not None:
          _run(*tc, "filter", "add", "dev", end, "parent", "1:", "protocol", "ip", "prio", "1",
               "u32", "match", "ip", match, f"{peer.address}/32", "flowid", classid)

  def set_rate(self, rate_mbit: float) -> None:
    """Every site's link capped at `rate_mbit` from now on, both ways (the class counters start
    again from 0)."""
    self.rate_mbit = rate_mbit
    for site in self.sites:
      self._shape(site)

  # ---- Ray --------------------------------------------------------------------------------------

  def driver_env(self) -> dict[str, str]:
    """What a driver of the cluster (the command) needs in its environment, as every node has it:
    Ray's token authentication on, and libtpu's log directory: Ray's log monitor streams
    /tmp/tpu_logs to the driver, which on this machine holds other jobs' logs, megabytes of them,
    that would cross the links. A site's are its own (empty)."""
    tpu_logs = self.workdir / "tpu_logs"
    tpu_logs.mkdir(exist_ok=True)
    return {"RAY_AUTH_MODE": "token", "TPU_LOG_DIR": str(tpu_logs)}

  def _node_env(self) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    return {**env, **self.driver_env()}

  def _start_ray(self) -> None:
    with socket.socket() as probe:
      probe.bind((self.gateway, 0))
      port = probe.getsockname()[1]
    self.head_address = f"{self.gateway}:{port}"
    head = ["--head", f"--node-ip-address={self.gateway}", f"--port={port}", "--num-cpus=0",
            "--include-dashboard=false"]
    if self._system_config:
      head.append(f"--system-config={json.dumps(self._system_config)}")
    self._head = self._ray_start("head", [], head)
    self._wait_started(self._head, "head")
    for site in self.sites:
      resources = json.dumps({site.resource: 1} if site.resource else {})
      self._nodes.append(self._ray_start(
          f"site{site.index}", ["ip", "netns", "exec", site.namespace],
          [f"--address={self.head_address}", f"--node-ip-address={site.address}",
           f"--num-cpus={self._num_cpus}", f"--resources={resources}"]))
    for node, site in zip(self._nodes, self.sites):
      self._wait_started(node, f"site{site.index}")

  def _ray_start(self, name: str, wrap: list[str], args: list[str]) -> subprocess.Popen:
    """`ray start --block` (it holds its node's processes until killed) in a session of its own,
    with a temp dir of its own: nodes on one machine must not share sockets or session files."""
    temp = self.workdir / name
    temp.mkdir()
    with open(self.workdir / f"{name}.log", "w", encoding="utf-8") as log:
      return subprocess.Popen(
          [*wrap, RAY, "start", *args, f"--temp-dir={temp}", "--disable-usage-stats", "--block"],
          stdout=log, stderr=subprocess.STDOUT, env=self._node_env(), start_new_session=True)

  def _wait_started(self, process: subprocess.Popen, name: str) -> None:
    log = self.workdir / f"{name}.log"
    deadline = time.monotonic() + _START_TIMEOUT_S
    while _STARTED not in log.read_text(errors="replace"):
      if process.poll() is not None or time.monotonic() > deadline:
        raise RuntimeError(f"the Ray node of {name} did not start: "
                           f"{log.read_text(errors='replace')[-3000:]}")
      time.sleep(0.1)

  # ---- the links --------------------------------------------------------------------------------

  def link_counters(self) -> dict[int, LinkCounters]:
    """Per site, its link's counters now (read at the bridge-side end: its rx is the site's tx)."""
    counters = {}
    for site in self.sites:
      stats = pathlib.Path("/sys/class/net") / site.host_link / "statistics"
      read = lambda key, s=stats: int((s / key).read_text())
      counters[site.index] = LinkCounters(read("rx_bytes"), read("tx_bytes"), read("rx_packets"),
                                          read("tx_packets"))
    return counters

  def peer_counters(self) -> dict[int, dict[int | str, LinkCounters]]:
    """Per site, its link's bytes by peer: each other site (by index) and "others" (the head and
    the command), from the htb class counters of both ends. Frames here are segments of at most
    the MTU (the interface counters see the large segments the stack hands down whole)."""
    found = {}
    for site in self.sites:
      sent = self._classes(site.site_link, site.namespace)
      received = self._classes(site.host_link, None)
      peers = {p.index: str(10 + p.index) for p in self.sites if p is not site}
      peers["others"] = str(_OTHERS)
      found[site.index] = {peer: LinkCounters(sent[c][0], received[c][0], sent[c][1],
                                              received[c][1]) for peer, c in peers.items()}
    return found

  def _classes(self, link: str, namespace: str | None) -> dict[str, tuple[int, int]]:
    """A link end's htb leaf classes: minor id -> (bytes, frames) sent through it."""
    tc = ["ip", "netns", "exec", namespace, "tc"] if namespace else ["tc"]
    text = _run(*tc, "-s", "class", "show", "dev", link)
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _CLASS.finditer(text)}

  def cut(self, index: int) -> None:
    """Site `index`'s link goes down: nothing reaches or leaves it (a partition)."""
    _run("ip", "link", "set", self.sites[index].host_link, "down")

  def restore(self, index: int) -> None:
    """Its link comes back (the same qdiscs, the same rate)."""
    _run("ip", "link", "set", self.sites[index].host_link, "up")

  def partition(self, index: int, seconds: float) -> None:
    """The link of site `index` down for `seconds`, then back."""
    self.cut(index)
    try:
      time.sleep(seconds)
    finally:
      self.restore(index)

  # ---- tear-down --------------------------------------------------------------------------------

  def _namespace_pids(self) -> set[int]:
    """Every process inside the sites' namespaces: all of them ours (the namespaces are)."""
    pids = set()
    for site in self.sites:
      listed = subprocess.run(["ip", "netns", "pids", site.namespace], capture_output=True,
                              text=True, check=False).stdout
      pids.update(int(p) for p in listed.split())
    return pids

  def _head_pids(self) -> set[int]:
    """The head's `ray start`, its process tree and its session (a worker a raylet started may
    have left the tree). Read while its process is not reaped yet: its pid, the session's id,
    cannot be anyone else's then."""
    import psutil  # pylint: disable=g-import-not-at-top  (Ray's own dependency)
    processes = [p for p in [self._head, *self._nodes] if p is not None and p.returncode is None]
    pids = {p.pid for p in processes}
    for process in processes:
      with contextlib.suppress(psutil.NoSuchProcess):
        pids.update(c.pid for c in psutil.Process(process.pid).children(recursive=True))
    for other in psutil.process_iter():
      with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
        if os.getsid(other.pid) in {p.pid for p in processes}:
          pids.add(other.pid)
    return pids

  def _kill_all(self) -> None:
    """SIGKILL to every process of ours, again until none is left (a dying raylet may still
    start a worker). Through psutil's handles, which check a pid still names the process they
    were made for: a pid freed and reused meanwhile is someone else's."""
    import psutil  # pylint: disable=g-import-not-at-top
    targets = _processes(self._head_pids() | self._namespace_pids())
    deadline = time.monotonic() + 30
    while targets and time.monotonic() < deadline:
      for target in targets:
        with contextlib.suppress(psutil.NoSuchProcess):
          target.kill()
      for process in [self._head, *self._nodes]:
        if process is not None:
          process.wait()
      _, alive = psutil.wait_procs(targets, timeout=2)
      targets = [p for p in alive if _running(p)] + _processes(self._namespace_pids())

  def close(self) -> None:
    """Kills every process of the sites and removes the namespaces, links and files they hold."""
    self._kill_all()
    for site in self.sites:
      subprocess.run(["ip", "netns", "del", site.namespace], capture_output=True, check=False)
      # The root-side end goes with its peer's namespace, but not at once everywhere.
      subprocess.run(["ip", "link", "del", site.host_link], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
    for hosts_dir in self._hosts_dirs:
      shutil.rmtree(hosts_dir, ignore_errors=True)
    with contextlib.suppress(OSError):
      pathlib.Path("/etc/netns").rmdir()  # only if no other namespace has files there
    shutil.rmtree(self.workdir, ignore_errors=True)
    self.sites, self._nodes, self._head = [], [], None

  def leftovers(self) -> list[str]:
    """Namespaces and links of this prefix still on the machine (none after `close`)."""
    names = _run("ip", "netns", "list").split()
    links = [line.split()[0] for line in _run("ip", "-br", "link").splitlines()]
    return [n for n in names + links if n.startswith(self.prefix)]


def _processes(pids) -> list:
  """psutil handles of those of `pids` that still run."""
  import psutil  # pylint: disable=g-import-not-at-top
  found = []
  for pid in pids:
    with contextlib.suppress(psutil.NoSuchProcess):
      found.append(psutil.Process(pid))
  return found


def _running(process) -> bool:
  """Whether a psutil handle's process still runs (a zombie waiting for its parent does not)."""
  import psutil  # pylint: disable=g-import-not-at-top
  try:
    return process.status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def _main(argv: Sequence[str]) -> int:
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--sites", default="learner_host,learner_host,syncer_host",
                      help="one custom Ray resource per site, comma-separated")
  parser.add_argument("--rate_mbit", type=float, default=100.0, help="every link's cap, Mbit/s")
  parser.add_argument("command", nargs="*", help="run beside the head; HEAD is its address")
  args = parser.parse_args(argv)
  reason = unavailable()
  if reason:
    print(reason, file=sys.stderr)
    return 2
  resources = args.sites.split(",")
  with Sites(len(resources), args.rate_mbit, resources=resources) as sites:
    for site in sites.sites:
      print(f"site {site.index}: namespace {site.namespace}, {site.address}, resource "
            f"{site.resource!r}, link {site.host_link} at {args.rate_mbit} Mbit/s")
    print(f"head {sites.head_address} (RAY_AUTH_MODE=token for the driver)", flush=True)
    if not args.command:
      with contextlib.suppress(KeyboardInterrupt):
        signal.pause()
      return 0
    command = [a.replace("HEAD", sites.head_address) for a in args.command]
    return subprocess.run(command, env={**os.environ, **sites.driver_env()},
                          check=False).returncode


if __name__ == "__main__":
  sys.exit(_main(sys.argv[1:]))
