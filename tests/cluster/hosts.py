"""Test hosts on this machine: network namespaces joined by a bridge, for the multi-node tests.

``Cluster(("h1", "h2"))`` makes, for one test run, a switch namespace holding a bridge and one
namespace per host, joined to the bridge by a veth pair whose host end is ``eth0`` with the
address ``SUBNET.<i>`` (``10.77.0.1``, ``10.77.0.2``, ...). Every link is made inside the
namespaces, none in this machine's own, so removing the namespaces removes every link. A
process started with ``cluster.command(host, argv)`` runs in that host's network namespace,
in a UTS namespace whose hostname is the host's name and in an IPC namespace of its own, and
resolves every host's name to its address (``ip netns exec`` mounts
``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``). The IPC namespace is what keeps two
hosts' ranks off each other's memory: in one IPC namespace UCX finds its shared-memory
transports usable between ranks of different hosts (the same machine), and the link carries
next to nothing; in separate ones, the traffic between hosts crosses the link and the ranks
of one host still share memory (``test_cluster_allreduce`` checks both). Nothing listens
anywhere but on the hosts' own addresses, which only the hosts can reach.

``cluster.launcher`` is an executable that takes ssh's place for MPICH's hydra
(``mpiexec -launcher ssh -launcher-exec LAUNCHER``): hydra calls ``LAUNCHER -x HOST CMD`` once
per other host, and the launcher runs ``CMD`` in that host as ``command`` does.

Clean-up: every name this run makes (namespaces, ``/etc/netns`` folders, the launcher's
folder) starts with ``fmhost-<pid>-<start time>-``, the pid and start time of the process that
made the cluster. ``cluster.remove()`` kills every process in its namespaces and removes what
it made; a guard process, in a session of its own, does the same as soon as the making
process ends without doing it (a test killed with SIGKILL); and a new ``Cluster`` first removes
what any earlier run whose process is gone left behind (``remove_leftovers``).
``unavailable_reason()`` says why namespaces cannot be made here (None when they can); the
tests skip with it.
"""
import glob
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

PREFIX = "fmhost"
# fmhost-<pid>-<start time in clock ticks>-c<cluster of that process>-<host or "switch">
NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-")
SUBNET = "10.77.0"
SWITCH = "switch"
ETC_NETNS = "/etc/netns"
_CLUSTERS = itertools.count()
HOST_NAME = re.compile(r"^[a-z][a-z0-9]{0,11}$")
# How long removal waits for killed processes to leave a namespace before it gives up.
REMOVE_SECONDS = 10
# What a host's processes run under, beside its network namespace (see above).
UNSHARE = "unshare --uts --ipc"
LAUNCHER = """#!/bin/sh
# hydra's ssh launcher in a test cluster: called as LAUNCHER [-x] HOST CMD
[ "$1" = "-x" ] && shift
host="$1"
shift
exec ip netns exec "{prefix}$host" {unshare} sh -c "hostname $host && exec $*"
"""


def unavailable_reason():
    """Why this machine cannot make the test hosts, or None."""
    for program in ("ip", "unshare"):
        if shutil.which(program) is None:
            return f"{program} is not installed (iproute2, util-linux)"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{_prefix()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"this machine refuses network namespaces: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _start_time(pid):
    """The start time of process ``pid`` in clock ticks (field 22 of /proc/pid/stat), or
    None when there is no such process; with the pid it names one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


def _prefix(pid=None):
    pid = os.getpid() if pid is None else pid
    return f"{PREFIX}-{pid}-{_start_time(pid)}-"


def _ip(*argv, check=True):
    result = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout


def link_names():
    """The names of the links in this machine's own network namespace (a cluster adds none)."""
    return sorted(line.split(":")[1].strip() for line in _ip("-o", "link").splitlines())


def namespaces(prefix=PREFIX):
    """The network namespaces whose names start with ``prefix``."""
    names = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    return sorted(name for name in names if name.startswith(prefix))


def processes(prefix=PREFIX):
    """The ids of the processes inside the namespaces whose names start with ``prefix``."""
    return sorted({int(pid) for name in namespaces(prefix)
                   for pid in _ip("netns", "pids", name, check=False).split()})


def remove(prefix):
    """Kill every process in the namespaces named ``prefix...`` and remove those namespaces,
    their ``/etc/netns`` folders and the launcher's folder; RuntimeError if some remain."""
    deadline = time.monotonic() + REMOVE_SECONDS
    while True:
        for pid in processes(prefix):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name in namespaces(prefix):
            # refused (busy) while a killed process still holds it; the next round retries
            _ip("netns", "del", name, check=False)
        if not namespaces(prefix) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for path in glob.glob(os.path.join(ETC_NETNS, prefix + "*")) + glob.glob(
            os.path.join(tempfile.gettempdir(), prefix + "*")):
        shutil.rmtree(path, ignore_errors=True)
    left = namespaces(prefix)
    if left:
        raise RuntimeError(f"network namespaces {left} could not be removed: processes "
                           f"{processes(prefix)} hold them")


def remove_leftovers():
    """Remove what earlier runs left whose making process has ended (killed before it or
    its guard could clean up); the prefixes removed."""
    names = namespaces() + [os.path.basename(path) for path in glob.glob(
        os.path.join(ETC_NETNS, PREFIX + "-*")) + glob.glob(
        os.path.join(tempfile.gettempdir(), PREFIX + "-*"))]
    dead = set()
    for name in names:
        match = NAME.match(name)
        if match and _start_time(int(match.group(1))) != match.group(2):
            dead.add(match.group(0))
    for prefix in sorted(dead):
        remove(prefix)
    return sorted(dead)


class Host:
    """One test host: its name (also its hostname), address and network namespace."""

    def __init__(self, name, address, namespace):
        self.name, self.address, self.namespace = name, address, namespace

    def __repr__(self):
        return f"Host({self.name!r}, {self.address!r}, {self.namespace!r})"


class Cluster:
    """Hosts named ``names`` on one bridge; ``remove()`` (or the guard) takes them away."""

    def __init__(self, names=("h1", "h2")):
        bad = [name for name in names if not HOST_NAME.match(name) or name == SWITCH]
        if bad or len(set(names)) != len(names) or not 1 <= len(names) <= 250:
            raise ValueError(f"host names {list(names)!r}: give 1 to 250 different names of a "
                             f"lower-case letter then up to 11 letters or digits, not {SWITCH!r}")
        remove_leftovers()
        self.prefix = f"{_prefix()}c{next(_CLUSTERS)}-"
        self.hosts = [Host(name, f"{SUBNET}.{i}", self.prefix + name)
                      for i, name in enumerate(names, start=1)]
        self.switch = self.prefix + SWITCH
        self.guard = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--guard", self.prefix],
            stdin=subprocess.PIPE, start_new_session=True)
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self):
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{host.address} {host.name}\n" for host in self.hosts)
        for i, host in enumerate(self.hosts, start=1):
            _ip("netns", "add", host.namespace)
            port = f"p{i}"
            _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", host.namespace)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            os.makedirs(os.path.join(ETC_NETNS, host.namespace))
            with open(os.path.join(ETC_NETNS, host.namespace, "hosts"), "w") as out:
                out.write(hosts_file)
        folder = tempfile.mkdtemp(prefix=self.prefix + "launcher-")
        self.launcher = os.path.join(folder, "launcher")
        with open(self.launcher, "w") as out:
            out.write(LAUNCHER.format(prefix=self.prefix, unshare=UNSHARE))
        os.chmod(self.launcher, 0o755)

    def host(self, name):
        return next(host for host in self.hosts if host.name == name)

    def command(self, name, argv):
        """``argv`` as a command that runs it on host ``name`` (its namespace and hostname)."""
        host = self.host(name)
        return ["ip", "netns", "exec", host.namespace, *UNSHARE.split(), "sh", "-c",
                f'hostname {host.name} && exec "$@"', "sh", *argv]

    def hydra_arguments(self):
        """The arguments that make hydra (``mpiexec``) start its proxies through the launcher."""
        return ["-launcher", "ssh", "-launcher-exec", self.launcher]

    def processes(self):
        return processes(self.prefix)

    def remove(self):
        """Kill every process on the hosts and remove everything this cluster made."""
        try:
            remove(self.prefix)
        finally:
            self.guard.stdin.close()
            self.guard.wait()


def _guard(prefix):
    """Wait for the making process to end (its end of stdin closes), then remove ``prefix``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.buffer.read()
    remove(prefix)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--guard"] and len(sys.argv) == 3:
        _guard(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} --guard PREFIX (run by Cluster)")
