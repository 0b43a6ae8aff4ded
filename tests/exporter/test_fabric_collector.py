"""The fabric collector against sysfs trees laid out as real nodes lay them out: a dual-port ConnectX-3,
ConnectX-7 InfiniBand ports beside GPUs under one PCIe switch, a port that lost its link, a RoCE port
with its netdev, hw_counters, a missing counter file, ``N/A (no PMA)``, a permission error."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from exporter_helpers import HERE, FakeClock, assert_golden, make_collector, promtool_check, scrape, value
from gpuhealth.exporter.collector import Context
from gpuhealth.exporter.collectors.fabric import READ_EVERY_SECONDS
from gpuhealth.exporter.fabric_manager import FabricManagerProbe
from gpuhealth.exporter.fabric_settings import FabricSettings
from gpuhealth.exporter.inventory import GpuIdentity, nvidia_gpus_on_pci
from gpuhealth.exporter.sysfs_fabric import MAX_PORTS, parse_rate, parse_state

SYSFS = HERE / "fixtures" / "sysfs-fabric"
QUIET = FabricSettings(systemctl=(), manager_pid_file=None)  # no fabric manager on this host


def fabric_context(sysfs: Path | None = SYSFS, settings: FabricSettings = QUIET,
                   clock: FakeClock | None = None) -> Context:
    ctx = Context(sysfs=sysfs, fabric=settings, procfs=Path("/proc"), clock=clock or FakeClock())
    for index, bus in enumerate(("18", "9A", "3B")):  # GPU 2 is not in the tree
        ctx.inventory.add(GpuIdentity(index, f"GPU-{index}", f"00000000:{bus}:00.0", "NVIDIA H100 80GB HBM3",
                                      "", ""))
    return ctx


def test_fabric_golden() -> None:
    settings = FabricSettings(expected_rate_gbps=400, switches={"mlx5_0": "leaf-r3-a"}, systemctl=(),
                              manager_pid_file=None)
    text = scrape(make_collector("fabric", fabric_context(settings=settings)))
    assert_golden("fabric", text)
    promtool_check(text)
    port = {"device": "mlx5_0", "port": "1"}
    assert value(text, "gpuhealth_nic_port_info", **port, link_layer="InfiniBand", netdev="",
                 switch="leaf-r3-a") == 1
    assert value(text, "gpuhealth_nic_port_up", **port) == 1
    assert value(text, "gpuhealth_nic_port_rate_bytes_per_second", **port) == 5e10  # 400 Gb/sec (4X NDR)
    assert value(text, "gpuhealth_nic_port_expected_rate_bytes_per_second", **port) == 5e10
    assert value(text, "gpuhealth_nic_port_errors_total", **port, error="symbol_error") == 41
    assert value(text, "gpuhealth_nic_port_hw_errors_total", **port, counter="local_ack_timeout_err") == 131
    assert value(text, "gpuhealth_nic_port_hw_errors_total", **port, counter="rx_read_requests") is None
    # both ports of the dual-port HCA
    assert value(text, "gpuhealth_nic_port_link_downed_total", device="mlx4_0", port="2") == 3
    assert value(text, "gpuhealth_nic_port_rate_bytes_per_second", device="mlx4_0", port="1") == 5e9
    # the port that lost its link: down, its states as numbers
    down = {"device": "mlx5_1", "port": "1"}
    assert value(text, "gpuhealth_nic_port_up", **down) == 0
    assert value(text, "gpuhealth_nic_port_state", **down) == 1
    assert value(text, "gpuhealth_nic_port_physical_state", **down) == 2
    assert value(text, "gpuhealth_nic_port_link_downed_total", **down) == 17
    # RoCE: the netdev named on the port and read from class/net
    assert value(text, "gpuhealth_nic_port_info", device="mlx5_2", port="1", link_layer="Ethernet",
                 netdev="ens6np0", switch="") == 1
    assert value(text, "gpuhealth_netdev_carrier_changes_total", netdev="ens6np0") == 7
    assert value(text, "gpuhealth_netdev_up", netdev="ens6np0") == 1
    assert value(text, "gpuhealth_netdev_speed_bytes_per_second", netdev="ens6np0") == 2.5e10
    # odd values are left out and counted: N/A (no PMA), a missing counter file
    assert value(text, "gpuhealth_nic_port_errors_total", **down, error="port_xmit_discards") is None
    assert value(text, "gpuhealth_fabric_read_errors_total", device="mlx5_1", error="malformed") == 1
    assert value(text, "gpuhealth_nic_port_errors_total", device="mlx5_2", port="1",
                 error="local_link_integrity_errors") is None
    assert value(text, "gpuhealth_fabric_read_errors_total", device="mlx5_2", error="missing") == 1
    # affinity: the GPU under the same PCIe switch, else on the same NUMA node
    assert value(text, "gpuhealth_nic_gpu_affinity_info", device="mlx5_0", gpu="0", scope="pcie_switch") == 1
    assert value(text, "gpuhealth_nic_gpu_affinity_info", device="mlx5_1", gpu="1", scope="pcie_switch") == 1
    assert value(text, "gpuhealth_nic_gpu_affinity_info", device="mlx5_2", gpu="1", scope="numa_node") == 1
    assert value(text, "gpuhealth_nic_gpu_affinity_info", device="mlx5_0", gpu="1", scope="numa_node") is None
    assert "gpuhealth_fabric_manager_up" not in text


def test_expected_rate_per_device_and_absent_when_not_configured() -> None:
    settings = FabricSettings(expected_rate_by_device={"mlx5_2": 200}, systemctl=(), manager_pid_file=None)
    text = scrape(make_collector("fabric", fabric_context(settings=settings)))
    expected = "gpuhealth_nic_port_expected_rate_bytes_per_second"
    assert value(text, expected, device="mlx5_2", port="1") == 2.5e10
    assert value(text, expected, device="mlx5_0", port="1") is None
    text = scrape(make_collector("fabric", fabric_context()))
    assert "gpuhealth_nic_port_expected_rate_bytes_per_second{" not in text


@pytest.mark.parametrize(("text", "number"), [
    ("4: ACTIVE", 4), ("1: DOWN", 1), ("5: LinkUp", 5), ("ACTIVE", None), ("x: DOWN", None), ("", None),
    ("4: A: B", None)])
def test_port_states_parse_to_their_numbers(text: str, number: int | None) -> None:
    assert parse_state(text) == number


@pytest.mark.parametrize(("text", "rate"), [("400 Gb/sec (4X NDR)", 5e10), ("2.5 Gb/sec (1X SDR)", 3.125e8),
                                            ("100 Gb/sec", 1.25e10), ("fast", None), ("400 Mb/sec", None),
                                            ("nan Gb/sec", None), ("-1 Gb/sec", None), ("", None)])
def test_rates_parse_to_bytes_per_second(text: str, rate: float | None) -> None:
    assert parse_rate(text) == rate


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "sys"
    shutil.copytree(SYSFS, tree, symlinks=True)
    return tree


def test_sysfs_is_read_on_the_slow_schedule_not_every_run(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    clock = FakeClock()
    collector = make_collector("fabric", fabric_context(tree, clock=clock))
    counter = {"device": "mlx5_0", "port": "1", "error": "symbol_error"}
    assert value(scrape(collector), "gpuhealth_nic_port_errors_total", **counter) == 41
    symbol_errors = tree / "devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1a:00.0" \
        "/infiniband/mlx5_0/ports/1/counters/symbol_error"
    symbol_errors.write_text("50\n")
    clock.advance(READ_EVERY_SECONDS - 1)
    assert value(scrape(collector), "gpuhealth_nic_port_errors_total", **counter) == 41
    clock.advance(1)
    assert value(scrape(collector), "gpuhealth_nic_port_errors_total", **counter) == 50


def test_odd_trees_never_fail_the_collector(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    port = tree / "class/infiniband/mlx5_0/ports/1"
    (port / "state").write_text("garbage\n")
    (port / "rate").write_text("unknown\n")
    (port / "counters" / "symbol_error").unlink()
    (port / "counters" / "symbol_error").mkdir()  # EISDIR
    shutil.rmtree(port / "hw_counters")
    (tree / "class/infiniband/mlx5_1/device").unlink()  # no PCI placement
    (tree / "class/infiniband/mlx9_9").mkdir()  # an HCA without ports
    text = scrape(make_collector("fabric", fabric_context(tree)))
    promtool_check(text)
    key = {"device": "mlx5_0", "port": "1"}
    assert value(text, "gpuhealth_nic_port_state", **key) is None
    assert value(text, "gpuhealth_nic_port_up", **key) is None  # unknown, not down
    assert value(text, "gpuhealth_nic_port_physical_state", **key) == 5
    assert value(text, "gpuhealth_nic_port_rate_bytes_per_second", **key) is None
    assert value(text, "gpuhealth_fabric_read_errors_total", device="mlx5_0", error="malformed") == 2
    assert value(text, "gpuhealth_fabric_read_errors_total", device="mlx5_0", error="io") == 1
    assert value(text, "gpuhealth_nic_port_hw_errors_total", **key, counter="local_ack_timeout_err") is None
    assert not [line for line in text.splitlines() if "affinity" in line and 'device="mlx5_1"' in line]
    assert value(text, "gpuhealth_nic_port_up", device="mlx4_0", port="1") == 1


def test_no_sysfs_and_no_infiniband_publish_no_ports(tmp_path: Path) -> None:
    assert "gpuhealth_nic_port" not in scrape(make_collector("fabric", fabric_context(None)))
    text = scrape(make_collector("fabric", fabric_context(tmp_path)))
    assert "gpuhealth_nic_port" not in text and "gpuhealth_fabric_read_errors_total{" not in text


_SCRAPE = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_fabric_collector import fabric_context
from exporter_helpers import make_collector, scrape
print(scrape(make_collector("fabric", fabric_context(Path({tree!r})))))
"""


def test_a_counter_file_refused_by_permission_is_left_out_and_counted(tmp_path: Path) -> None:
    tree = _copy(tmp_path)
    refused = tree / "class/infiniband/mlx5_0/ports/1/counters/link_error_recovery"
    refused.chmod(0)
    # root reads any file: drop the capabilities that let it, as an unprivileged exporter runs
    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all"]
    drop = drop if os.getuid() == 0 else []
    done = subprocess.run([*drop, sys.executable, "-c", _SCRAPE.format(tests=str(HERE), tree=str(tree))],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert value(text, "gpuhealth_nic_port_errors_total", device="mlx5_0", port="1",
                 error="link_error_recovery") is None
    assert value(text, "gpuhealth_nic_port_errors_total", device="mlx5_0", port="1",
                 error="symbol_error") == 41
    assert value(text, "gpuhealth_fabric_read_errors_total", device="mlx5_0", error="permission") == 1


def _systemctl(tmp_path: Path, output: str, code: int = 0, pause: float = 0) -> tuple[str, ...]:
    script = tmp_path / "systemctl"
    script.write_text(f"#!/bin/sh\nsleep {pause}\nprintf '{output}'\nexit {code}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return (str(script),)


@pytest.mark.parametrize(("output", "code", "up"), [
    ("LoadState=loaded\\nActiveState=active\\n", 0, True),
    ("LoadState=loaded\\nActiveState=failed\\n", 0, False),
    ("LoadState=loaded\\nActiveState=inactive\\n", 0, False),
    ("LoadState=not-found\\nActiveState=inactive\\n", 0, None),  # no fabric manager on this host
    ("System has not been booted with systemd\\n", 1, None),
])
def test_the_fabric_manager_state_from_systemd(tmp_path: Path, output: str, code: int,
                                               up: bool | None) -> None:
    settings = FabricSettings(systemctl=_systemctl(tmp_path, output, code),
                              manager_pid_file=tmp_path / "none.pid")
    assert FabricManagerProbe(settings, Path("/proc"), FakeClock()).probe() is up


def test_without_systemd_the_pid_file_says(tmp_path: Path) -> None:
    pid_file = tmp_path / "nv-fabricmanager.pid"
    settings = FabricSettings(systemctl=_systemctl(tmp_path, "LoadState=not-found\\n"),
                              manager_pid_file=pid_file)
    probe = FabricManagerProbe(settings, Path("/proc"), FakeClock())
    pid_file.write_text(f"{os.getpid()}\n")
    assert probe.probe() is True
    pid_file.write_text("4194304\n")  # above pid_max: no such process
    assert probe.probe() is False
    pid_file.write_text("nv-fabricmanager\n")
    assert probe.probe() is None
    assert probe.errors[("", "malformed")] == 1


def test_the_collector_publishes_the_fabric_manager_when_the_answer_arrives(tmp_path: Path) -> None:
    settings = FabricSettings(systemctl=_systemctl(tmp_path, "LoadState=loaded\\nActiveState=active\\n"))
    collector = make_collector("fabric", fabric_context(settings=settings))
    deadline = time.monotonic() + 30
    while value(scrape(collector), "gpuhealth_fabric_manager_up") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    up = value(scrape(collector), "gpuhealth_fabric_manager_up")
    assert up == 1


def test_a_hung_systemctl_is_cut_at_the_deadline_and_counted(tmp_path: Path) -> None:
    settings = FabricSettings(systemctl=_systemctl(tmp_path, "LoadState=loaded\\n", pause=30))
    probe = FabricManagerProbe(settings, Path("/proc"), FakeClock(), deadline=0.2)
    assert probe.probe() is None  # the last answer, none yet
    assert probe.errors[("", "timeout")] == 1


def _plant_hostile_files(port: Path) -> None:
    """A FIFO no one writes, a 1 GiB sparse file and a loop of links where attributes should be."""
    os.mkfifo(port / "fifo")
    (port / "state").unlink()
    (port / "state").symlink_to(port / "fifo")
    with open(port / "rate", "r+b") as f:
        f.truncate(1 << 30)
    (port / "counters" / "symbol_error").unlink()
    (port / "counters" / "symbol_error").symlink_to("symbol_error")


def test_fifos_huge_files_and_link_loops_in_the_tree_are_bounded_reads(tmp_path: Path) -> None:
    """A FIFO blocked the collector for good (and every read after it); the RoCE port's netdev file and
    the PCI bus's vendor and class files were read whole."""
    tree = _copy(tmp_path)
    _plant_hostile_files(tree / "class/infiniband/mlx5_0/ports/1")
    roce = tree / "class/infiniband/mlx4_0/ports/2"
    (roce / "link_layer").write_text("Ethernet\n")
    (roce / "gid_attrs/ndevs").mkdir(parents=True)
    (roce / "gid_attrs/ndevs/0").write_text("../../../../etc" + " " * (1 << 20))  # a path, then 1 MiB
    pci = tree / "bus/pci/devices/0000:99:00.0"
    pci.mkdir(parents=True)
    os.mkfifo(pci / "vendor")
    with open(pci / "class", "wb") as f:
        f.truncate(1 << 30)
    done: list[str] = []
    collector = make_collector("fabric", fabric_context(tree))
    reader = threading.Thread(target=lambda: done.append(scrape(collector)), daemon=True)
    reader.start()
    reader.join(30)
    assert done, "the collector blocked on a FIFO"
    text = done[0]
    promtool_check(text)
    key = {"device": "mlx5_0", "port": "1"}
    assert value(text, "gpuhealth_nic_port_state", **key) is None
    assert value(text, "gpuhealth_nic_port_physical_state", **key) == 5
    assert value(text, "gpuhealth_nic_port_info", device="mlx4_0", port="2", link_layer="Ethernet", netdev="",
                 switch="") == 1
    assert "etc" not in text
    assert nvidia_gpus_on_pci(tree) is not None


def test_thousands_of_ports_make_a_bounded_number_of_series(tmp_path: Path) -> None:
    root = tmp_path / "class/infiniband"
    for device in range(300):
        for port in (1, 2):
            path = root / f"mlx5_{device}/ports/{port}"
            (path / "counters").mkdir(parents=True)
            (path / "state").write_text("4: ACTIVE\n")
    text = scrape(make_collector("fabric", fabric_context(tmp_path)))
    states = [line for line in text.splitlines() if line.startswith("gpuhealth_nic_port_state{")]
    assert len(states) == MAX_PORTS
    assert value(text, "gpuhealth_fabric_read_errors_total", device="", error="over_limit") == 600 - MAX_PORTS
