"""Host, NFS and job collectors against the fixture procfs tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from exporter_helpers import (
    FakeClock,
    assert_golden,
    make_collector,
    promtool_check,
    scrape,
    sim_context,
    value,
)
from gpuhealth.exporter.collector import Context
from gpuhealth.exporter.collectors.jobs import slurm_job_of
from gpuhealth.exporter.collectors.nfs import parse_mountstats
from gpuhealth.exporter.metrics import Families, render
from gpuhealth.exporter.procfs_file import PROCFS_FILE_BYTES, read_procfs
from prometheus_client.parser import text_string_to_metric_families


def test_host_golden(procfs: Path) -> None:
    text = scrape(make_collector("host", Context(procfs=procfs)))
    assert_golden("host", text)
    promtool_check(text)
    assert value(text, "gpuhealth_host_interrupts_total") == 987654321
    assert value(text, "gpuhealth_host_procs_running") == 37
    assert value(text, "gpuhealth_host_cpu_seconds_total", mode="iowait") == 45.0
    assert value(text, "gpuhealth_host_disk_written_bytes_total", device="nvme0n1") == 96000000 * 512
    assert value(text, "gpuhealth_host_disk_read_bytes_total", device="nvme0n1p1") is None  # a partition
    assert value(text, "gpuhealth_host_network_receive_bytes_total", device="lo") is None
    assert value(text, "gpuhealth_host_network_transmit_bytes_total", device="ib0") == 4444444444444
    assert value(text, "gpuhealth_host_page_outs_total") == 4567890


def test_host_on_this_machine_reads_real_procfs() -> None:
    text = scrape(make_collector("host", Context(procfs=Path("/proc"))))
    assert value(text, "gpuhealth_host_memory_total_bytes") > 0
    assert value(text, "gpuhealth_host_context_switches_total") > 0


def test_nfs_golden(procfs: Path) -> None:
    text = scrape(make_collector("nfs", Context(procfs=procfs)))
    assert_golden("nfs", text)
    promtool_check(text)
    write = {"mount": "/mnt/ckpt", "op": "WRITE"}
    assert value(text, "gpuhealth_nfs_rpc_queue_seconds_total", **write) == 41850.0
    assert value(text, "gpuhealth_nfs_rpc_transmissions_total", **write) - \
        value(text, "gpuhealth_nfs_rpc_operations_total", **write) == 12  # retransmissions
    assert value(text, "gpuhealth_nfs_transport_backlog_queue_total", mount="/mnt/ckpt") == 7200000
    assert value(text, "gpuhealth_nfs_transport_sends_total", mount="/home") == 2000  # udp transport
    assert value(text, "gpuhealth_nfs_rpc_operations_total", mount="/home", op="GETATTR") == 2000


@pytest.mark.parametrize("text", [
    "", "device\n",
    "device a mounted on /x with fstype nfs4\n\txprt: tcp 1 2\n\tper-op statistics\n\tREAD: 1 x\n",
    "garbage\nper-op statistics\nREAD: 1 2 3 4 5 6 7 8\n",
])
def test_mountstats_parser_tolerates_odd_input(text: str) -> None:
    for stats in parse_mountstats(text):
        assert stats.ops == {} and stats.sends == 0


def test_slurm_job_from_cgroup_then_environment(procfs: Path) -> None:
    assert slurm_job_of(procfs, 4242) == "771234"
    assert slurm_job_of(procfs, 4343) == "771299"
    assert slurm_job_of(procfs, 999999) is None


def test_jobs_golden(clock: FakeClock) -> None:
    processes = [{"pid": 4242, "gpus": [0, 1]}, {"pid": 4343, "gpus": [1]}, {"pid": 999999, "gpus": [3]}]
    scenario = {"gpus": 4, "nvlinks": 0, "processes": processes}
    ctx = sim_context(scenario, clock)
    scrape(make_collector("gpu", ctx))
    text = scrape(make_collector("jobs", ctx))
    assert_golden("jobs", text)
    promtool_check(text)
    assert value(text, "gpuhealth_gpu_job_info", gpu="1", job_id="771299") == 1
    assert value(text, "gpuhealth_gpu_job_info", gpu="1", job_id="771234") == 1
    assert value(text, "gpuhealth_gpu_job_info", gpu="2", job_id="771234") is None


@pytest.mark.parametrize("value", [b'1"} 1\ngpuhealth_gpu_up{gpu="0"} 0', b"9" * 5000, b"\xff\xfe", b"-1",
                                   b"12 13", b"771234\n"])
def test_a_job_id_a_user_sets_in_the_environment_must_be_a_slurm_job_id(tmp_path: Path, value: bytes) -> None:
    """Anyone can start a GPU process with SLURM_JOB_ID set to anything: only a job id's grammar is read."""
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "environ").write_bytes(b"HOME=/x\0SLURM_JOB_ID=" + value + b"\0")
    assert slurm_job_of(tmp_path, 77) is None
    (tmp_path / "77" / "environ").write_bytes(b"SLURM_JOB_ID=771234\0")
    assert slurm_job_of(tmp_path, 77) == "771234"


def test_names_that_are_not_utf8_break_neither_a_collector_nor_the_exposition(procfs: Path,
                                                                              tmp_path: Path) -> None:
    """Interface and mount names are bytes to the kernel (a Latin-1 directory, a renamed netdev)."""
    root = tmp_path / "proc"
    shutil.copytree(procfs, root)
    net = (root / "net/dev").read_bytes().replace(b"ib0:", b"ib\xff\"\\0:")
    (root / "net/dev").write_bytes(net)
    mounts = (root / "self/mountstats").read_bytes()
    mounts = mounts.replace(b"mounted on /mnt/ckpt ", b"mounted on /mnt/caf\xe9 ")
    (root / "self/mountstats").write_bytes(mounts)
    host = scrape(make_collector("host", Context(procfs=root)))
    nfs = scrape(make_collector("nfs", Context(procfs=root)))
    promtool_check(host)
    promtool_check(nfs)
    assert value(host, "gpuhealth_host_network_transmit_bytes_total", device='ib\\xff"\\0') == 4444444444444
    assert {"/mnt/caf\\xe9", "/home"} <= {labels.get("mount") for labels in _label_sets(nfs)}


def _label_sets(text: str) -> list[dict[str, str]]:
    return [dict(s.labels) for family in text_string_to_metric_families(text) for s in family.samples]


def test_a_label_value_python_cannot_encode_is_rendered_escaped_not_fatal() -> None:
    families = Families()
    families.add("gpuhealth_nfs_transport_sends_total", 1, ["/mnt/\udcff"])
    families.add("gpuhealth_nfs_transport_sends_total", 2, ["/mnt/\ud800\r"])
    text = render(families).decode()
    promtool_check(text)
    assert len(_label_sets(text)) == 2


def test_a_cgroup_named_with_bytes_that_are_not_utf8_does_not_stop_job_attribution(tmp_path: Path) -> None:
    (tmp_path / "78").mkdir()
    (tmp_path / "78" / "cgroup").write_bytes(b"0::/user.slice/user@1000.service/\xff\xfe\n")
    (tmp_path / "78" / "environ").write_bytes(b"SLURM_JOB_ID=4711\0")
    assert slurm_job_of(tmp_path, 78) == "4711"
    (tmp_path / "78" / "cgroup").write_bytes(b"0::/system.slice/slurmstepd.scope/job_4712/\xff\n")
    assert slurm_job_of(tmp_path, 78) == "4712"


@pytest.mark.parametrize("name", ["stat", "self/mountstats"])
def test_a_procfs_file_past_its_bound_fails_the_collector(procfs: Path, tmp_path: Path, name: str) -> None:
    """``--path.procfs`` may be a crafted tree: a file of any size is refused once past the bound."""
    root = tmp_path / "proc"
    shutil.copytree(procfs, root)
    collector = make_collector("nfs" if "mountstats" in name else "host", Context(procfs=root))
    scrape(collector)
    with (root / name).open("a") as grown:
        grown.write("x" * (PROCFS_FILE_BYTES + 1) + "\n")
    with pytest.raises(OSError, match="more than"):
        scrape(collector)


def test_a_procfs_path_that_is_not_a_regular_file_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "stat"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # a writer that never writes: a blocking read would wait forever
    try:
        with pytest.raises(OSError, match="not a regular file"):
            read_procfs(fifo)
    finally:
        os.close(writer)
    with pytest.raises(OSError, match="not a regular file"):
        read_procfs("/dev/zero")


def test_an_environment_past_what_exec_allows_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "79").mkdir()
    (tmp_path / "79" / "environ").write_bytes(b"PAD=" + b"x" * (8 << 20) + b"\0SLURM_JOB_ID=4711\0")
    assert slurm_job_of(tmp_path, 79) is None
    (tmp_path / "79" / "environ").write_bytes(b"PAD=" + b"x" * (1 << 20) + b"\0SLURM_JOB_ID=4711\0")
    assert slurm_job_of(tmp_path, 79) == "4711"
