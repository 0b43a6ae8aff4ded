"""A real Slurm cluster on loopback: munged, slurmctld and one slurmd per node, all on this host.

The webhook's Slurm backend, the closed-loop demo and the end-to-end tests act on real Slurm daemons
rather than on a model of them, so drain reasons, requeue rules and reboot requests behave exactly as
Slurm 22.05 makes them behave. Every daemon binds 127.0.0.1 on a port chosen free at start; the munge
key, sockets, state and spool directories live in temporary folders removed by ``stop()``.

Node reboots are simulated: Slurm's ``RebootProgram`` only records the request, and
``complete_reboot(node)`` restarts that node's slurmd as a freshly booted one (``slurmd -b``), so that
``nextstate=RESUME`` returns it to service as after a real reboot.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gpuhealth.local.process import ManagedProcess, ProcessError, free_port, wait_until
from gpuhealth.local.training_job import checkpoint_dir
from gpuhealth.webhook.backends.scontrol import job_fields, parse_node_line

log = logging.getLogger(__name__)
T = TypeVar("T")

SBIN_PATH = "/usr/sbin:/usr/bin"
TOOLS = ("scontrol", "squeue", "sbatch", "sinfo", "scancel")
_LOG_STAMP = re.compile(r"\[([0-9T:.-]+)\] ")
NODE_ENV = "GPUHEALTH_SLURM_NODE"


class SlurmError(RuntimeError):
    """A Slurm client command failed; the message carries its stderr."""


@dataclass(frozen=True)
class NodeInfo:
    """A node as ``scontrol show node`` prints it: ``state`` with its flags (``IDLE+DRAIN``), and its
    reason as printed, Slurm's ``[user@time]`` included."""

    name: str
    state: str
    reason: str

    @property
    def flags(self) -> set[str]:
        return set(self.state.split("+"))


@dataclass(frozen=True)
class JobInfo:
    """A job as ``scontrol show job`` prints it, node lists expanded to names."""

    job_id: str
    state: str
    nodes: list[str]
    excluded: list[str]
    reason: str
    restarts: int


def _poll(fetch: Callable[[], T], predicate: Callable[[T], bool], timeout: float, what: str) -> T:
    """Fetch until ``predicate`` holds; a timeout names what was last seen, so that a wait that failed
    in a loaded run says where Slurm stood (a node NOT_RESPONDING, still DOWN, still rebooting)."""
    found: list[T] = []

    def check() -> bool:
        found[:] = [fetch()]
        return predicate(found[0])
    try:
        wait_until(check, timeout, interval=0.2, what=what)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; last seen: {found[0] if found else 'nothing'}") from None
    return found[0]


def _binary(name: str) -> str:
    path = shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SBIN_PATH}")
    if path is None:
        raise ProcessError(f"{name} not found; install the Debian packages "
                           "'slurmctld slurmd slurm-client munge'")
    return path


class SlurmCluster:
    """``nodes`` slurmd named ``<prefix>01``.. in one partition, a controller and a private munged."""

    def __init__(self, workdir: Path | None = None, nodes: int = 4, prefix: str = "gpu",
                 partition: str = "gpu", cpus_per_node: int = 1) -> None:
        if nodes < 1:
            raise ValueError("a Slurm cluster needs at least one node")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", prefix):
            raise ValueError(f"node name prefix {prefix!r} must be a hostname label (a-z, 0-9, '-')")
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gpuhealth-slurm-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        width = max(2, len(str(nodes)))
        self.node_names = [f"{prefix}{i:0{width}d}" for i in range(1, nodes + 1)]
        self.partition = partition
        self.cpus_per_node = cpus_per_node
        self.conf_path = self.workdir / "slurm.conf"
        self.reboot_log = self.workdir / "reboots.log"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf_path)}
        self._munge_dir: Path | None = None
        self._munged: ManagedProcess | None = None
        self._slurmctld: ManagedProcess | None = None
        self._slurmd: dict[str, ManagedProcess] = {}
        self._ports: dict[str, int] = {}
        self._reboots_done: dict[str, int] = {}

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Start every daemon and wait until all nodes are IDLE; on failure nothing is left behind."""
        try:
            if os.geteuid() != 0:
                raise ProcessError("a local Slurm cluster must be started as root: slurmd runs jobs as "
                                   "their submitting user and the daemons run as SlurmUser=root here")
            binaries = {name: _binary(name) for name in ("munged", "slurmctld", "slurmd", *TOOLS)}
            self._start_munged(binaries["munged"])
            self._write_config()
            self._slurmctld = ManagedProcess(
                "slurmctld", [binaries["slurmctld"], "-D", "-f", self.conf_path],
                self.workdir / "slurmctld.out", env=self.env).start()
            self._slurmctld.wait_ready(self._controller_answers, timeout)
            for node in self.node_names:
                self._start_slurmd(node)
            self._slurmctld.wait_ready(self._nodes_ready, timeout)
        except BaseException:
            self.stop()
            raise
        log.info("event=slurm_cluster_ready conf=%s nodes=%s", self.conf_path, ",".join(self.node_names))
        return self

    def _nodes_ready(self) -> bool:
        for daemon in self._slurmd.values():
            if not daemon.running:
                raise ProcessError(f"{daemon.name} exited:\n{daemon.log_tail()}")
        return self._all_idle(self.node_names)

    def _start_munged(self, munged: str) -> None:
        # munged insists that its socket directory be world-searchable and its key private, which the
        # 0700 temporary folders of pytest are not; a short /tmp path also keeps the socket under 108 bytes.
        # slurmd's spool (its step sockets) lives there too, whatever the length of ``workdir``.
        self._munge_dir = Path(tempfile.mkdtemp(prefix="gpuhealth-munge-"))
        self._munge_dir.chmod(0o755)
        key_dir = self._munge_dir / "key"
        key_dir.mkdir(mode=0o700)
        key = key_dir / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(stat.S_IRUSR)
        self._munged = ManagedProcess("munged", [
            munged, "-F", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--pid-file={self._munge_dir / 'munged.pid'}", f"--seed-file={key_dir / 'seed'}",
            f"--log-file={self.workdir / 'munged.log'}",
        ], self.workdir / "munged.out").start()
        self._munged.wait_ready(self.munge_socket.exists, timeout=10)

    @property
    def _spool(self) -> Path:
        """slurmd spool dirs: Unix sockets named there must stay under 108 bytes, so not in ``workdir``."""
        assert self._munge_dir is not None, "munged starts first"
        return self._munge_dir / "spool"

    def _start_slurmd(self, node: str, rebooted: bool = False) -> None:
        (self._spool / node).mkdir(parents=True, exist_ok=True)
        argv: list[str | Path] = [_binary("slurmd"), "-D", *(["-b"] if rebooted else []), "-N", node, "-f",
                                  self.conf_path]
        env = {**self.env, NODE_ENV: node}  # the RebootProgram, run by this slurmd, names its node
        self._slurmd[node] = ManagedProcess(f"slurmd-{node}", argv, self.workdir / f"slurmd.{node}.out",
                                            env=env).start()

    def stop(self) -> None:
        """Cancel every job, then stop the node daemons, the controller and munged. Safe to call twice."""
        if self._slurmctld is not None and self._slurmctld.running:
            with contextlib.suppress(SlurmError, subprocess.TimeoutExpired):
                self.run("scancel", f"--partition={self.partition}", timeout=10)
                wait_until(lambda: not self.run("squeue", "-h", "-o", "%i", timeout=10).strip(), 15,
                           interval=0.3, what="jobs to end")
        for daemon in self._slurmd.values():
            daemon.stop()
        self._kill_job_leftovers()
        for central in (self._slurmctld, self._munged):
            if central is not None:
                central.stop()
        if self._munge_dir is not None:
            shutil.rmtree(self._munge_dir, ignore_errors=True)
            self._munge_dir = None
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill_job_leftovers(self) -> None:
        """Job steps (slurmstepd and the job's processes) run in their own sessions, outside the slurmd's
        process group; the jobs we submit run in our workdir, so any process still there is ours."""
        root = str(self.workdir.resolve())
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cwd = os.readlink(proc / "cwd")
            except OSError:
                continue
            if cwd == root or cwd.startswith(root + "/"):
                log.warning("event=slurm_leftover_killed pid=%s cwd=%s", proc.name, cwd)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.name), signal.SIGKILL)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def daemons(self) -> list[ManagedProcess]:
        """munged, slurmctld and every slurmd, as started."""
        return [d for d in (self._munged, self._slurmctld, *self._slurmd.values()) if d is not None]

    @property
    def controller_port(self) -> int:
        return self._ports["slurmctld"]

    @property
    def munge_socket(self) -> Path:
        if self._munge_dir is None:
            raise RuntimeError("munged is not started")
        return self._munge_dir / "munge.sock"

    def _write_config(self) -> None:
        self._ports = {"slurmctld": free_port(), **{node: free_port() for node in self.node_names}}
        host = socket.gethostname().split(".")[0]
        reboot = self.workdir / "reboot-program"
        reboot.write_text(f'#!/bin/sh\necho "${NODE_ENV} $(date +%s) $*" >> {self.reboot_log}\n')
        reboot.chmod(0o755)
        lines = [
            "# Generated by gpuhealth.local.slurm: a throwaway loopback cluster.",
            "ClusterName=gpuhealth",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self._ports['slurmctld']}",
            "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.workdir / 'state'}",
            f"SlurmdSpoolDir={self._spool}/%n",
            f"SlurmctldPidFile={self.workdir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.workdir / 'slurmd.%n.pid'}",
            f"SlurmctldLogFile={self.workdir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.workdir / 'slurmd.%n.log'}",
            f"RebootProgram={reboot}",
            "ProctrackType=proctrack/linuxproc",  # reaps a cancelled job at once; pgid polls for seconds
            "TaskPlugin=task/none",
            "SelectType=select/linear",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "SlurmdParameters=config_overrides",
            # a node set DOWN for not responding returns when its slurmd registers again; one set DOWN
            # on purpose (a reboot with nextstate=DOWN, until gpuhealth-validate passed) stays DOWN
            "ReturnToService=1",
            "JobRequeue=1",
            "KillWait=2",
            "MessageTimeout=5",
            "SlurmdTimeout=10",  # nodes are pinged every third of it: a resumed node answers sooner
            "ResumeTimeout=600",
            *(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={self._ports[node]} "
              f"CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN" for node in self.node_names),
            f"PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        (self.workdir / "state").mkdir(exist_ok=True)
        self.conf_path.write_text("\n".join(lines) + "\n")

    def _controller_answers(self) -> bool:
        try:
            return "UP" in self.run("scontrol", "ping", timeout=5)
        except (SlurmError, subprocess.TimeoutExpired):
            return False

    def _all_idle(self, nodes: list[str]) -> bool:
        try:
            return all(self.node(n).state == "IDLE" for n in nodes)
        except (SlurmError, subprocess.TimeoutExpired):
            return False

    # --- client commands -------------------------------------------------------------------------

    def run(self, tool: str, *args: str, timeout: float = 30.0) -> str:
        """Run a Slurm client against this cluster; its stdout, or ``SlurmError`` with its stderr."""
        proc = subprocess.run([_binary(tool), *map(str, args)], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise SlurmError(f"{tool} {' '.join(map(str, args))}: exit {proc.returncode}: "
                             f"{(proc.stderr or proc.stdout).strip()}")
        return proc.stdout

    def scontrol(self, *args: str) -> str:
        return self.run("scontrol", *args)

    def squeue(self, *args: str) -> str:
        return self.run("squeue", *args)

    def sbatch(self, *args: str) -> str:
        """Submit a batch job from the cluster's folder (so ``stop`` can find its processes); its id."""
        out = self.run("sbatch", "--parsable", f"--chdir={self.workdir}",
                       f"--output={self.workdir / 'job-%j.out'}", *args)
        return out.strip().split(";")[0]

    def submit_training_job(self, nodes: int = 2, seconds: int = 600, name: str = "train",
                            checkpoint_interval: float = 30.0, step_seconds: float = 0.2) -> str:
        """A requeueable multi-node training job (``training_job.py``), started on ``nodes`` nodes;
        returns once it runs. It checkpoints every ``checkpoint_interval`` seconds and on SIGUSR1 into
        ``checkpoint_dir(job_id)``, and resumes from there after a requeue; ``seconds`` of training."""
        command = [sys.executable, "-m", "gpuhealth.local.training_job",
                   "--interval", str(checkpoint_interval), "--step-seconds", str(step_seconds),
                   "--steps", str(max(int(seconds / step_seconds), 1))]
        # exec: the job's batch process is the trainer itself, so "scancel --signal=USR1 --batch" reaches it
        job_id = self.sbatch("--requeue", "--open-mode=append", f"--nodes={nodes}", f"--job-name={name}",
                             "--wrap", f"exec {shlex.join(command)}")
        self.wait_job(job_id, lambda job: job.state == "RUNNING", what=f"job {job_id} to run")
        return job_id

    def checkpoint_dir(self, job_id: str) -> Path:
        """Where training job ``job_id`` keeps its checkpoints (``training_job.newest_checkpoint``)."""
        return checkpoint_dir(self.workdir, job_id)

    def hostnames(self, hostlist: str) -> list[str]:
        """Expand a Slurm hostlist (``gpu[01-02,04]``) the way Slurm does."""
        if hostlist in ("", "(null)"):
            return []
        return self.scontrol("show", "hostnames", hostlist).split()

    def node(self, name: str) -> NodeInfo:
        parsed = parse_node_line(self.scontrol("show", "node", name, "-o").strip())
        return NodeInfo(name, parsed.state, parsed.printed_reason)

    def job(self, job_id: str) -> JobInfo:
        fields = job_fields(self.scontrol("show", "job", job_id, "-o"),
                            ("JobState", "NodeList", "ExcNodeList", "Reason", "Restarts"))
        return JobInfo(job_id, fields.get("JobState", ""), self.hostnames(fields.get("NodeList", "")),
                       self.hostnames(fields.get("ExcNodeList", "")), fields.get("Reason", ""),
                       int(fields.get("Restarts", "0")))

    def jobs_on(self, node: str) -> list[str]:
        return self.squeue("-h", "-w", node, "-o", "%i").split()

    def wait_job(self, job_id: str, predicate: Callable[[JobInfo], bool], timeout: float = 30.0,
                 what: str = "") -> JobInfo:
        """Poll ``scontrol show job`` until ``predicate(JobInfo)``; the matching JobInfo."""
        return _poll(lambda: self.job(job_id), predicate, timeout, what or f"job {job_id}")

    def wait_node(self, node: str, predicate: Callable[[NodeInfo], bool], timeout: float = 30.0,
                  what: str = "") -> NodeInfo:
        """Poll ``scontrol show node`` until ``predicate(NodeInfo)``; the matching NodeInfo."""
        return _poll(lambda: self.node(node), predicate, timeout, what or f"node {node}")

    def logged(self, pattern: str) -> list[tuple[float, re.Match[str]]]:
        """(time, match) of each slurmctld log line matching ``pattern``, in order: Slurm's own record
        of what it did and when (``[2026-12-02T03:14:39.900] sched: Allocate JobId=1 NodeList=...``)."""
        found = []
        for line in (self.workdir / "slurmctld.log").read_text().splitlines():
            stamp = _LOG_STAMP.match(line)
            if stamp and (match := re.search(pattern, line[stamp.end():])):
                found.append((datetime.datetime.fromisoformat(stamp[1]).timestamp(), match))
        return found

    # --- simulation helpers ----------------------------------------------------------------------

    def reboot_requests(self) -> list[str]:
        """The node of each reboot Slurm asked the RebootProgram to perform, in order."""
        try:
            return [line.split()[0] for line in self.reboot_log.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            return []

    def reboot_issued(self, node: str) -> bool:
        """Slurm has had ``node``'s slurmd run the RebootProgram, and the reboot is not completed yet."""
        return self.reboot_requests().count(node) > self._reboots_done.get(node, 0)

    def complete_reboot(self, node: str, timeout: float = 30.0) -> None:
        """Bring ``node`` back as if it had rebooted: once its slurmd has run the RebootProgram (Slurm
        issues the reboot when the node is idle), it restarts and reports a fresh boot, so that the
        reboot's ``nextstate`` applies."""
        wait_until(lambda: self.reboot_issued(node), timeout, interval=0.2,
                   what=f"{node} to run its RebootProgram")
        self._reboots_done[node] = self._reboots_done.get(node, 0) + 1
        self._slurmd[node].stop()
        self._start_slurmd(node, rebooted=True)
        self.wait_node(node, lambda info: not {"REBOOT_ISSUED", "REBOOT_REQUESTED"} & info.flags, timeout,
                       f"{node} to finish rebooting")

    def reset(self, timeout: float = 30.0) -> None:
        """Cancel every job and return every node to IDLE with no reason: a clean slate between tests."""
        self.run("scancel", f"--partition={self.partition}")
        wait_until(lambda: not self.squeue("-h", "-o", "%i").strip(), timeout, interval=0.2,
                   what="jobs to end")
        for node in self.node_names:
            flags = self.node(node).flags
            if "REBOOT_ISSUED" in flags:
                self.complete_reboot(node, timeout)
            elif "REBOOT_REQUESTED" in flags:
                self.scontrol("cancel_reboot", node)
            if {"DRAIN", "DOWN", "FAIL"} & self.node(node).flags:
                self.scontrol("update", f"NodeName={node}", "State=RESUME")
        wait_until(lambda: self._all_idle(self.node_names), timeout, interval=0.2, what="all nodes idle")
