"""The local Slurm cluster helper: parameters, readiness, and a teardown that leaves nothing behind."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from gpuhealth.local.process import ProcessError
from gpuhealth.local.slurm import SlurmCluster

pytestmark = pytest.mark.slow


def _cwd(proc: Path) -> str:
    try:
        return os.readlink(proc / "cwd")
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def assert_nothing_left(pids: list[int], workdir: Path) -> None:
    assert not workdir.exists()
    assert [pid for pid in pids if not _gone(pid)] == []
    assert [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cwd(p).startswith(str(workdir))] == []


def test_local_cluster_parameters_and_teardown():
    cluster = SlurmCluster(nodes=2, prefix="node", partition="batch")
    with cluster:
        assert cluster.node_names == ["node01", "node02"]
        assert cluster.run("sinfo", "-h", "-o", "%P %D %t").split() == ["batch*", "2", "idle"]
        job = cluster.submit_training_job(nodes=2, name="train")
        assert sorted(cluster.job(job).nodes) == ["node01", "node02"]
        pids = [daemon.proc.pid for daemon in cluster.daemons]
        assert len(pids) == 4
        workdir = cluster.workdir
    assert_nothing_left(pids, workdir)


class PortTaken(SlurmCluster):
    """A cluster whose last node's port is taken by someone else before its slurmd starts."""

    def _write_config(self) -> None:
        super()._write_config()
        self.squatter = socket.socket()
        self.squatter.bind(("127.0.0.1", self._ports[self.node_names[-1]]))
        self.squatter.listen()


def test_a_node_that_cannot_start_fails_clearly_and_leaves_nothing():
    cluster = PortTaken(nodes=2)
    try:
        with pytest.raises(ProcessError, match=r"slurmd-gpu02 exited:(.|\n)*Address already in use"):
            cluster.start(timeout=30)
    finally:
        cluster.squatter.close()
    assert cluster.daemons and all(not d.running for d in cluster.daemons)
    assert_nothing_left([d.proc.pid for d in cluster.daemons], cluster.workdir)


def test_invalid_parameters_are_refused():
    with pytest.raises(ValueError, match="hostname"):
        SlurmCluster(nodes=2, prefix="GPU_")
    with pytest.raises(ValueError, match="at least one node"):
        SlurmCluster(nodes=0)
