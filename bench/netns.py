"""An emulated cluster on one machine: a Linux network namespace per host, a shaped link per rank.

    cluster = Cluster(hosts=2, per_host=2, rate="1gbit", delay="100us")
    cluster.build()                                  # needs root, ip and tc (iproute2)
    proc = spawn(cluster, rank, [sys.executable, "worker.py"], env)   # runs in its host
    ...
    cluster.close()                                  # removes everything it made

The pieces (P: this process id, so concurrent runs never meet):

- ``rcbench-P-br``: a namespace holding one bridge, the *switch*;
- ``rcbench-P-h<h>``: host h. Its L ranks run inside it, so they share its network
  namespace (ringcomm's host identity; they reach each other through ipc and shared-memory
  lanes, as ranks of one machine do) and see each other's ``/dev/shm``;
- per rank r = h·L + i, a veth pair: ``v<i>`` in host h with address 10.77.0.<10+r>/24, its
  other end a port of the bridge. Each rank has a link of its own, as a GPU server with a
  NIC per GPU has: source routing in the host (a rule per address, and a table routing
  it out of its own veth) sends what rank r's address sends out of ``v<i>``, and ARP is
  answered only by the interface that owns the address. A rank binds its own address
  (``RINGCOMM_IFADDR``), and ringcomm then connects from it.
- ``rate`` (tc tbf, both directions: on ``v<i>`` for what the rank uploads, on the bridge
  port for what it downloads) and, where given, ``delay`` (netem, on the upload side: one
  way, so a round trip pays it once) make each link a full-duplex link of that rate into a
  non-blocking switch.

Nothing is added to the machine's own namespace; the addresses exist only in these
namespaces. ``close`` deletes the namespaces (their veth ends go with them).
"""
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

SUBNET, FIRST_HOST = "10.77.0", 10
PREFIX = "rcbench-"
STARTED = []  # every process spawn() started


def sh(*argv, check=True):
    """Run ip/tc; raise with its stderr if it fails."""
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


class Cluster:
    """``hosts`` namespaces of ``per_host`` ranks each; ``close`` removes them."""

    def __init__(self, hosts, per_host=1, rate=None, delay=None):
        self.tag, self.hosts, self.per_host = f"{PREFIX}{os.getpid()}-", hosts, per_host
        self.n, self.rate, self.delay, self.spaces = hosts * per_host, rate, delay, []
        self.bridge = self.tag + "br"

    def ns(self, rank):
        """The namespace (host) rank ``rank`` runs in."""
        return f"{self.tag}h{rank // self.per_host}"

    def addr(self, rank):
        return f"{SUBNET}.{FIRST_HOST + rank}"

    def build(self):
        for name in stale_namespaces():  # left by a killed run whose process id was this one
            if name.startswith(self.tag):
                sh("ip", "netns", "delete", name, check=False)
        self._netns(self.bridge)
        sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for h in range(self.hosts):
            ns = f"{self.tag}h{h}"
            self._netns(ns)
            for key in ("arp_ignore=1", "arp_announce=2", "rp_filter=0"):
                for scope in ("all", "default"):
                    sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{scope}.{key}")
            for i in range(self.per_host):
                self._link(ns, h * self.per_host + i, i)

    def _link(self, ns, rank, i):
        nic, port, addr = f"v{i}", f"p{rank}", self.addr(rank)
        sh("ip", "link", "add", nic, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.bridge)
        sh("ip", "-n", self.bridge, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", nic)
        sh("ip", "-n", ns, "link", "set", nic, "up")
        table = str(100 + i)
        sh("ip", "-n", ns, "rule", "add", "from", addr, "table", table)
        sh("ip", "-n", ns, "route", "add", f"{SUBNET}.0/24", "dev", nic, "src", addr, "table", table)
        if self.rate:
            up = ["tc", "-n", ns, "qdisc", "add", "dev", nic, "root", "handle", "1:", "tbf",
                  "rate", self.rate, "burst", "256kb", "latency", "100ms"]
            sh(*up)
            if self.delay:
                self._netem(ns, nic, "parent", "1:1", "handle", "10:")
            sh("tc", "-n", self.bridge, "qdisc", "add", "dev", port, "root", "tbf", "rate", self.rate,
               "burst", "256kb", "latency", "100ms")
        elif self.delay:
            self._netem(ns, nic, "root")

    def _netem(self, ns, nic, *where):
        done = sh("tc", "-n", ns, "qdisc", "add", "dev", nic, *where, "netem", "delay", self.delay,
                  "limit", "100000", check=False)
        if done.returncode:
            raise RuntimeError(f"cannot add a delay of {self.delay} (tc netem: {done.stderr.strip()}; "
                               f"this kernel may lack sch_netem)")

    def _netns(self, name):
        sh("ip", "netns", "add", name)
        self.spaces.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def close(self):
        for name in reversed(self.spaces):  # deleting a namespace deletes its veth ends
            sh("ip", "netns", "delete", name, check=False)
        self.spaces = []

    def link_bytes(self):
        """Per rank, the bytes its link carried so far: (sent, received), read from the
        kernel's counters of its veth end."""
        out = []
        for rank in range(self.n):
            doc = json.loads(sh("ip", "-n", self.ns(rank), "-s", "-j", "link", "show", "dev",
                                f"v{rank % self.per_host}").stdout)
            stats = doc[0]["stats64"]
            out.append((stats["tx"]["bytes"], stats["rx"]["bytes"]))
        return out


def launch(cluster, argv, port, secret, **extra):
    """Start one ``python -m ringcomm.launch`` per host of ``cluster`` (inside the host, so
    its ranks share it), each rank binding its own link's address; returns the processes.
    ``argv``: the launcher's script or ``-m module`` and its arguments; ``extra``: more
    environment for every rank."""
    procs = []
    for h in range(cluster.hosts):
        first = h * cluster.per_host
        env = dict(os.environ, OMP_NUM_THREADS="1", RINGCOMM_SECRET=secret, **extra,
                   RINGCOMM_IFADDR=",".join(cluster.addr(first + i) for i in range(cluster.per_host)))
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        procs.append(spawn(cluster, first, [
            sys.executable, "-m", "ringcomm.launch", "--nnodes", str(cluster.hosts), "--node-rank", str(h),
            "--nproc", str(cluster.per_host), "--master-addr", cluster.addr(0), "--master-port", str(port),
            *argv], env))
    return procs


def run(cluster, argv, port, timeout, **extra):
    """One job on ``cluster`` (see :func:`launch`, a fresh secret); every host's output, or
    a RuntimeError with the output of each host that failed."""
    results = finish(launch(cluster, argv, port, secrets.token_hex(16), **extra), timeout)
    failed = [(h, rc, out) for h, (out, rc) in enumerate(results) if rc]
    if failed:
        raise RuntimeError(f"{' '.join(argv[:3])}: hosts {[h for h, _, _ in failed]} failed\n" +
                           "\n".join(f"--- host {h} (exit {rc}):\n{out[-1500:]}" for h, rc, out in failed))
    return [out for out, _ in results]


def finish(procs, timeout):
    """Each process's (output, exit code), waiting at most ``timeout`` seconds in all;
    a process still running then is killed."""
    deadline, results = time.monotonic() + timeout, []
    for proc in procs:
        try:
            out = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0] + f"\n(killed after {timeout:.0f} s)"
        results.append((out, proc.returncode))
    return results


def stale_namespaces():
    names = sh("ip", "netns", "list").stdout.split("\n")
    return [line.split()[0] for line in names if line.startswith(PREFIX)]


def preflight():
    """None if this process can build a cluster, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: apt-get install iproute2"
    probe = f"{PREFIX}{os.getpid()}-probe"
    result = sh("ip", "netns", "add", probe, check=False)
    if result.returncode:
        return f"network namespaces are not permitted here: {result.stderr.strip()}"
    sh("ip", "netns", "delete", probe, check=False)
    return None


def spawn(cluster, rank, argv, env=None, **popen):
    """Start ``argv`` inside rank ``rank``'s host, in its own process group."""
    popen = dict(dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), **popen)
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.ns(rank), *argv], env=env,
                            start_new_session=True, **popen)
    STARTED.append(proc)
    return proc


def kill_started():
    """SIGKILL every process group spawn() started that is still running."""
    for proc in STARTED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    STARTED.clear()
