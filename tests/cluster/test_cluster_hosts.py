"""The test cluster itself (``hosts.py``): each host has its own address, hostname and network,
the hosts reach each other by name, this machine's own network is untouched, and everything a
cluster made goes away: after ``remove()``, after the making process is killed with SIGKILL
(its guard), and at the start of the next run (leftovers of a dead run)."""
import json
import os
import subprocess
import sys
import textwrap

import hosts
from job_limits import HANG_SECONDS

# Run on a host: its hostname, network namespace, addresses, and a line from the other host
# got over TCP by name (the other host's name is argv[1]; "serve" makes this one the server).
PROBE = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    role, other = sys.argv[1], sys.argv[2]
    if role == "serve":
        with socket.create_server((socket.gethostbyname(socket.gethostname()), 7000)) as s:
            print("ready", flush=True)
            conn, _ = s.accept()
            conn.sendall(socket.gethostname().encode())
            conn.close()
    else:
        with socket.create_connection((other, 7000), timeout=20) as c:
            heard = c.recv(100).decode()
        addresses = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True,
                                   text=True).stdout
        print(json.dumps({"hostname": socket.gethostname(), "heard": heard,
                          "net": os.readlink("/proc/self/ns/net"),
                          "addresses": [l.split()[3] for l in addresses.splitlines()]}))
""")


def test_hosts_have_their_own_name_address_and_network(cluster):
    server = subprocess.Popen(cluster.command("h2", [sys.executable, "-c", PROBE, "serve", "-"]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n"
        client = subprocess.run(cluster.command("h1", [sys.executable, "-c", PROBE, "ask", "h2"]),
                                capture_output=True, text=True, timeout=HANG_SECONDS)
        assert client.returncode == 0, client.stderr
        assert server.wait(timeout=HANG_SECONDS) == 0
    finally:
        server.kill()
        server.wait()
    seen = json.loads(client.stdout)
    assert seen["hostname"] == "h1" and seen["heard"] == "h2"
    assert sorted(seen["addresses"]) == ["10.77.0.1/24", "127.0.0.1/8"]
    assert seen["net"] != os.readlink("/proc/self/ns/net")
    assert [host.address for host in cluster.hosts] == ["10.77.0.1", "10.77.0.2"]


def test_remove_ends_the_hosts_processes_and_leaves_nothing(cluster):
    links = hosts.link_names()
    sleeper = subprocess.Popen(cluster.command("h2", ["sleep", "600"]))
    assert cluster.processes()
    cluster.remove()
    assert sleeper.wait(timeout=HANG_SECONDS) != 0
    assert hosts.namespaces(cluster.prefix) == [] and cluster.processes() == []
    assert not [name for name in os.listdir(hosts.ETC_NETNS) if name.startswith(cluster.prefix)]
    assert not os.path.exists(os.path.dirname(cluster.launcher))
    assert cluster.guard.poll() == 0
    assert hosts.link_names() == links


# A run that makes a cluster, starts a process on a host and waits to be killed.
KILLED_RUN = textwrap.dedent("""
    import subprocess, sys
    import hosts
    cluster = hosts.Cluster(("h1", "h2"))
    subprocess.Popen(cluster.command("h1", ["sleep", "600"]))
    print(cluster.prefix, cluster.guard.pid, flush=True)
    sys.stdin.read()
""")


def test_a_run_killed_with_sigkill_is_removed_by_its_guard(cluster):
    run = subprocess.Popen([sys.executable, "-c", KILLED_RUN], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(hosts.__file__))
    prefix, guard = run.stdout.readline().split()
    assert hosts.namespaces(prefix) and hosts.processes(prefix)
    run.kill()
    run.wait()
    waited = 0.0
    while os.path.exists(f"/proc/{guard}") and waited < HANG_SECONDS:
        subprocess.run(["sleep", "0.05"])
        waited += 0.05
    assert not os.path.exists(f"/proc/{guard}")
    assert hosts.namespaces(prefix) == [] and hosts.processes(prefix) == []
    assert not [name for name in os.listdir(hosts.ETC_NETNS) if name.startswith(prefix)]
    assert hosts.namespaces(cluster.prefix)  # another live run's hosts are left alone


def test_leftovers_of_a_dead_run_are_removed_when_a_cluster_is_made(cluster):
    dead = f"{hosts.PREFIX}-{os.getpid()}-1-"  # this pid with another start time: a run gone
    subprocess.run(["ip", "netns", "add", dead + "h1"], check=True)
    os.makedirs(os.path.join(hosts.ETC_NETNS, dead + "h1"))
    sleeper = subprocess.Popen(["ip", "netns", "exec", dead + "h1", "sleep", "600"])
    try:
        second = hosts.Cluster(("h3",))
        second.remove()
        assert sleeper.wait(timeout=HANG_SECONDS) != 0
    finally:
        sleeper.kill()
        sleeper.wait()
    assert second.prefix != cluster.prefix
    assert hosts.namespaces(dead) == []
    assert not os.path.exists(os.path.join(hosts.ETC_NETNS, dead + "h1"))
    assert hosts.namespaces(cluster.prefix)  # the live run's hosts are left alone
