"""A real single-node Slurm cluster in a temporary directory, for the Slurm integration test.

``SlurmCluster(directory)`` writes a minimal slurm.conf there (state, spool, logs and pid files
all inside it; free TCP ports, so it does not meet a site's Slurm or another test run), starts
slurmctld and slurmd in the foreground as child processes and waits until the node is idle.
``cluster.env()`` is the environment under which sbatch, srun, sinfo and scontrol talk to it;
``cluster.submit(...)`` runs sbatch, ``cluster.wait(job)`` polls ``scontrol show job`` until the
job has ended (no slurmdbd, so no sacct) and returns its fields; ``cluster.stop()`` cancels what
still runs and ends the daemons. The node's address is 127.0.0.1, so no name lookup is needed.
Authentication is Slurm's auth/none plugin when this Slurm has it (Debian 12's 22.05 does),
else MUNGE with a private munged, key and socket.

``unavailable_reason()`` says why such a cluster cannot run here (None when it can); the test
skips with it.
"""
import os
import random
import re
import shutil
import socket
import subprocess
import time

PROGRAMS = ("slurmctld", "slurmd", "sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")
PLUGIN_DIRS = ("/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm",
               "/usr/lib64/slurm", "/usr/lib/slurm")
COMMAND_TIMEOUT = 20
# A job in one of these states has ended (``scontrol show job`` keeps it for MinJobAge).
ENDED_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                "PREEMPTED", "BOOT_FAIL", "DEADLINE")
# Variables of an enclosing job or MPI launcher that must not leak into this cluster's jobs.
FOREIGN_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_LOCAL")


def unavailable_reason():
    missing = [name for name in PROGRAMS if _find(name) is None]
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}); on Debian "
                "`apt-get install --no-install-recommends slurm-wlm` provides it (.ci/run does)")
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps as the submitting user"
    if not _auth_none_available() and _find("munged") is None:
        return ("this Slurm has no auth/none plugin and MUNGE is not installed "
                "(apt-get install munge)")
    return None


def _plugin(name):
    for directory in PLUGIN_DIRS:
        path = os.path.join(directory, name + ".so")
        if os.path.exists(path):
            return path
    return None


def _auth_none_available():
    return _plugin("auth_none") is not None and _plugin("cred_none") is not None


def _find(name):
    """The path of program ``name`` on PATH or in /usr/sbin (not on every root's PATH)."""
    found = shutil.which(name)
    if found is None and os.path.exists(os.path.join("/usr/sbin", name)):
        found = os.path.join("/usr/sbin", name)
    return found


def _executable(name):
    found = _find(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed")
    return found


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    def __init__(self, directory, cpus=2, start_timeout=30):
        self.directory = directory
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(directory, "slurm.conf")
        self.processes = []
        try:
            auth = self._start_auth()
            self._write_conf(cpus, auth)
            for daemon in ("slurmctld", "slurmd"):
                with open(self.path(daemon + ".out"), "w") as log:
                    self.processes.append(subprocess.Popen(
                        [_executable(daemon), "-D"], env=self.env(), stdout=log,
                        stderr=subprocess.STDOUT, start_new_session=True))
            self._wait_idle(start_timeout)
        except BaseException:
            self.stop()
            raise

    def env(self, base=None):
        """``base`` (default ``os.environ``) without an enclosing job's or launcher's
        variables, with ``SLURM_CONF`` naming this cluster."""
        base = os.environ if base is None else base
        env = {name: value for name, value in base.items()
               if not name.startswith(FOREIGN_PREFIXES)}
        env["SLURM_CONF"] = self.conf
        return env

    def run(self, args, **kwargs):
        """Run a Slurm command (``sbatch``, ``scontrol``, ...) against this cluster."""
        kwargs.setdefault("env", self.env())
        return subprocess.run(args, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                              **kwargs)

    def submit(self, sbatch_args, env=None, cwd=None):
        """``sbatch --parsable sbatch_args``; the job id."""
        result = self.run(["sbatch", "--parsable"] + list(sbatch_args),
                          env=self.env(env), cwd=cwd)
        if result.returncode != 0:
            raise RuntimeError(f"sbatch failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id):
        """The fields of ``scontrol show job --oneliner job_id`` as a dict."""
        result = self.run(["scontrol", "show", "job", "--oneliner", job_id])
        if result.returncode != 0:
            raise RuntimeError(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
        return dict(re.findall(r"(\S+?)=(\S*)", result.stdout))

    def wait(self, job_id, timeout):
        """The job's fields once it has ended; after ``timeout`` seconds the job is cancelled
        and TimeoutError raised with the daemons' logs."""
        deadline, fields = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in ENDED_STATES:
                return fields
            time.sleep(0.2)
        self.run(["scancel", job_id])
        raise TimeoutError(f"job {job_id} did not end within {timeout} s "
                           f"(state {fields.get('JobState')}):\n" + self.logs())

    def path(self, name):
        return os.path.join(self.directory, name)

    def _start_auth(self):
        """Slurm's settings for authentication, starting a private munged when it is needed."""
        if _auth_none_available():
            return "AuthType=auth/none\nCredType=cred/none\n"
        key, sock = self.path("munge.key"), self.path("munge.socket")
        with open(key, "wb") as f:
            f.write(os.urandom(128))
        os.chmod(key, 0o400)
        subprocess.run([_executable("munged"), "--force", f"--key-file={key}",
                        f"--socket={sock}", f"--pid-file={self.path('munged.pid')}",
                        f"--log-file={self.path('munged.log')}",
                        f"--seed-file={self.path('munged.seed')}"],
                       check=True, timeout=COMMAND_TIMEOUT, capture_output=True)
        return f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={sock}\n"

    def _write_conf(self, cpus, auth):
        """slurm.conf. Job ids start at a random number: MPICH names its node-local
        shared-memory segment after the PMI job name, which under srun is "<job id>.<step>",
        and a segment left in /dev/shm by a killed job of an earlier cluster with the same
        job id would be attached to by a new job and break its start (8 runs in 54 here)."""
        controller_port, node_port = _free_ports(2)
        for sub in ("state", "spool"):
            os.makedirs(self.path(sub), exist_ok=True)
        with open(self.conf, "w") as f:
            f.write(f"""ClusterName=fleetmpi-test
FirstJobId={random.randrange(10**6, 6 * 10**7)}
SlurmctldHost={self.host}(127.0.0.1)
SlurmctldPort={controller_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
{auth}StateSaveLocation={self.path('state')}
SlurmdSpoolDir={self.path('spool')}
SlurmctldPidFile={self.path('slurmctld.pid')}
SlurmdPidFile={self.path('slurmd.pid')}
SlurmctldLogFile={self.path('slurmctld.log')}
SlurmdLogFile={self.path('slurmd.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_idle(self, timeout):
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited with {process.returncode}:\n"
                                       + self.logs())
            result = self.run(["sinfo", "--noheader", "--format=%t"])
            state = result.stdout.strip()
            if result.returncode == 0 and state == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"the node is not idle after {timeout} s (sinfo: {state!r}):\n"
                           + self.logs())

    def _cancel_jobs(self, timeout=10):
        """Cancel every job still queued or running and wait (bounded) until none is left,
        so that no job step outlives the daemons."""
        try:
            self.run(["scancel", "--full", "--user", str(os.geteuid())])
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                listed = self.run(["squeue", "--noheader", "--format=%i"])
                if listed.returncode != 0 or not listed.stdout.strip():
                    return
                time.sleep(0.2)
        except (OSError, subprocess.TimeoutExpired):
            return

    def logs(self):
        """The daemons' logs, for a failure message."""
        parts = []
        for name in ("slurmctld.out", "slurmctld.log", "slurmd.out", "slurmd.log", "munged.log"):
            if os.path.exists(self.path(name)):
                with open(self.path(name)) as f:
                    parts.append(f"--- {name}\n" + "".join(f.readlines()[-30:]))
        return "\n".join(parts)

    def stop(self):
        if self.processes:
            self._cancel_jobs()
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        self.processes = []
        pid_file = self.path("munged.pid")
        if os.path.exists(pid_file):
            with open(pid_file) as f:
                pid = int(f.read().strip())
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                pass
