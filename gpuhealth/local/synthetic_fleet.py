"""A synthetic fleet of gpuhealth-exporter targets on one loopback HTTP server, for load tests.

Prometheus scrapes ``/metrics?node=<name>`` once per node, with the scheduler's node name set as the
``node`` target label exactly as the documented scrape config does, so the generated rules see the
label shapes of a real fleet. A few GPUs carry precursors so fusion has work to do.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass

from gpuhealth.contract.metrics import NIC_PORT_ERRORS
from gpuhealth.local.process import free_port

log = logging.getLogger(__name__)

MODEL = "NVIDIA H100 80GB HBM3"
CLOCK_REASONS = ("sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_slowdown",
                 "hw_power_brake_slowdown")
NVLINK_TYPES = ("crc_flit", "crc_data", "replay", "recovery")
NIC_RATE = 5e10  # 400 Gb/s NDR, in bytes per second
RACK_NODES = 16  # nodes behind one leaf switch


@dataclass(frozen=True)
class Series:
    text: str      # name{labels}
    value: float
    rate: float = 0.0  # a counter moving at this rate: value + rate * seconds since start


def _gpu_series(node: str, gpu: int, nvlinks: int, sick: bool) -> list[Series]:
    g = f'gpu="{gpu}"'
    out = [
        Series(f'gpuhealth_gpu_info{{{g},uuid="GPU-{node}-{gpu}",model="{MODEL}"}}', 1),
        Series(f"gpuhealth_gpu_up{{{g}}}", 1),
        Series(f"gpuhealth_gpu_temperature_celsius{{{g}}}", 72 if sick else 60 + gpu % 3),
        Series(f"gpuhealth_gpu_utilization_ratio{{{g}}}", 0.95),
        Series(f"gpuhealth_gpu_nvml_latency_seconds{{{g}}}", 0.05),
        Series(f'gpuhealth_gpu_ecc_errors_total{{{g},type="corrected",counter="volatile"}}', 0,
               0.5 if sick else 0),
        Series(f'gpuhealth_gpu_ecc_errors_total{{{g},type="uncorrected",counter="volatile"}}', 0),
        Series(f'gpuhealth_gpu_remapped_rows{{{g},type="correctable"}}', 3 if sick else 0),
        Series(f'gpuhealth_gpu_remapped_rows{{{g},type="uncorrectable"}}', 0),
        Series(f"gpuhealth_gpu_remap_pending{{{g}}}", 0),
        Series(f"gpuhealth_gpu_remap_failure{{{g}}}", 0),
        Series(f"gpuhealth_gpu_retired_pages_pending{{{g}}}", 0),
        Series(f"gpuhealth_gpu_pcie_replays_total{{{g}}}", 0, 1.0 if sick else 0),
        Series(f"gpuhealth_gpu_pcie_link_width_lanes{{{g}}}", 16),
        Series(f"gpuhealth_gpu_pcie_link_width_max_lanes{{{g}}}", 16),
        Series(f"gpuhealth_gpu_pcie_link_generation{{{g}}}", 5),
        Series(f"gpuhealth_gpu_pcie_link_generation_max{{{g}}}", 5),
        Series(f"gpuhealth_gpu_pcie_link_downgraded{{{g}}}", 0),
    ]
    if sick:   # the exporter creates an event counter at the GPU's first event, so few GPUs have one
        out.append(Series(f'gpuhealth_xid_events_total{{{g},xid="13"}}', 1))
        out.append(Series(f"gpuhealth_gpu_fallen_off_bus_total{{{g}}}", 1))
    out += [Series(f'gpuhealth_gpu_clock_event_seconds_total{{{g},reason="{r}"}}', 0,
                   0.3 if sick and r == "hw_thermal_slowdown" else 0) for r in CLOCK_REASONS]
    out += [Series(f'gpuhealth_gpu_nvlink_errors_total{{{g},link="{link}",type="{t}"}}', 0)
            for link in range(nvlinks) for t in NVLINK_TYPES]
    out.append(Series(f"gpuhealth_gpu_nvlink_errors_all_links_total{{{g}}}", 0))
    return out


def _nic_series(node: int, nic: int, sick: bool, down: bool) -> list[Series]:
    """One InfiniBand port as the exporter's fabric collector publishes it, beside GPU ``nic`` and
    behind its rack's named leaf switch; a sick port's link errors grow, a down port is not ACTIVE."""
    p = f'device="mlx5_{nic}",port="1"'
    return [
        Series(f'gpuhealth_nic_port_info{{{p},link_layer="InfiniBand",netdev="",'
               f'switch="leaf-{node // RACK_NODES:03d}"}}', 1),
        Series(f"gpuhealth_nic_port_up{{{p}}}", 0 if down else 1),
        Series(f"gpuhealth_nic_port_state{{{p}}}", 1 if down else 4),
        Series(f"gpuhealth_nic_port_physical_state{{{p}}}", 2 if down else 5),
        Series(f"gpuhealth_nic_port_rate_bytes_per_second{{{p}}}", 1.25e9 if down else NIC_RATE),
        Series(f"gpuhealth_nic_port_expected_rate_bytes_per_second{{{p}}}", NIC_RATE),
        Series(f"gpuhealth_nic_port_link_downed_total{{{p}}}", 1 if down else 0),
        *(Series(f'gpuhealth_nic_port_errors_total{{{p},error="{error}"}}', 0,
                 0.5 if sick and error in ("symbol_error", "link_error_recovery") else 0)
          for error in NIC_PORT_ERRORS),
        Series(f'gpuhealth_nic_gpu_affinity_info{{device="mlx5_{nic}",gpu="{nic}",scope="pcie_switch"}}', 1),
    ]


def _node_series(collapsed: bool) -> list[Series]:
    return [
        Series("gpuhealth_gpus_expected", 8),
        Series("gpuhealth_gpus_visible", 8),
        Series('gpuhealth_collector_success{collector="gpu"}', 1),
        Series("gpuhealth_host_interrupts_total", 0, 1500 if collapsed else 10_000),
        Series("gpuhealth_host_procs_running", 2 if collapsed else 40),
        Series("gpuhealth_host_page_outs_total", 0, 100),
        *(Series(f'gpuhealth_nfs_rpc_{m}{{mount="/ckpt",op="{op}"}}', 0, r)
          for op in ("WRITE", "GETATTR")
          for m, r in (("operations_total", 20), ("queue_seconds_total", 0.1),
                       ("execute_seconds_total", 0.2))),
    ]


class _ScrapeProtocol(asyncio.Protocol):
    """One kept-alive scrape connection: ``GET /metrics?node=<name>`` answered with that node's body.

    Thousands of targets are served from one event loop rather than a thread per connection: with a
    thread each, every scrape waits in line for the interpreter lock behind hundreds of idle peers,
    and on a loaded 2-core machine scrapes of 2,048 nodes then take seconds and run past their timeout.
    """

    def __init__(self, fleet: SyntheticFleet) -> None:
        self.fleet = fleet
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.fleet.connections.add(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        assert self.transport is not None
        self.fleet.connections.discard(self.transport)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            self.transport.write(self.fleet.response(head))
            if b"connection: close" in head.lower():
                self.transport.close()
                return


class SyntheticFleet:
    """``nodes`` nodes of ``gpus`` GPUs each and ``nics`` InfiniBand ports; one GPU (and one port) in
    ``sick_every`` carries precursors, one port in ``sick_every`` squared is down. With ``cluster``,
    every target also carries that ``cluster`` label, as a multi-cluster scrape config sets it."""

    def __init__(self, nodes: int, gpus: int = 8, nvlinks: int = 4, sick_every: int = 97,
                 cluster: str | None = None, nics: int = 0) -> None:
        self.cluster = cluster
        self.sick_every = sick_every
        self.names = [f"node{i:04d}" for i in range(nodes)]
        self.series: dict[str, list[Series]] = {}
        for index, name in enumerate(self.names):
            per_node = _node_series(collapsed=index % sick_every == 1)
            for gpu in range(gpus):
                per_node += _gpu_series(name, gpu, nvlinks, sick=(index * gpus + gpu) % sick_every == 0)
            for nic in range(nics):
                row = index * nics + nic
                per_node += _nic_series(index, nic, sick=row % sick_every == 3,
                                        down=row % sick_every**2 == 5)
            self.series[name] = per_node
        # Series that never move are formatted once: the fleet shares 2 cores with the Prometheus it
        # loads, and every CPU second spent here is one the benchmark would charge to the rules.
        self._static = {name: "".join(f"{s.text} {s.value:g}\n" for s in series if not s.rate).encode()
                        for name, series in self.series.items()}
        self._moving = {name: [s for s in series if s.rate] for name, series in self.series.items()}
        self.gpus = nodes * gpus
        self.started = time.monotonic()
        self.port = free_port()
        self.connections: set[asyncio.Transport] = set()
        self._server: tuple[asyncio.AbstractEventLoop, asyncio.Server, threading.Thread] | None = None

    def exposition(self, node: str) -> bytes:
        elapsed = time.monotonic() - self.started
        return self._static[node] + "".join(f"{s.text} {s.value + s.rate * elapsed:g}\n"
                                            for s in self._moving[node]).encode()

    def response(self, head: bytes) -> bytes:
        """The HTTP/1.1 response to one request's head: the node's exposition, or 404."""
        target = head.split(b"\r\n", 1)[0].split(b" ")[1:2]
        query = urllib.parse.urlparse(target[0].decode("latin-1")).query if target else ""
        node = urllib.parse.parse_qs(query).get("node", [""])[0]
        if node not in self.series:
            return b"HTTP/1.1 404 Not Found\r\nContent-Length: 13\r\n\r\nunknown node\n"
        body = self.exposition(node)
        return (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body)) + body

    def start(self) -> SyntheticFleet:
        """Listen at once (a taken port fails here, not in the thread) and serve from a daemon thread."""
        sock = socket.create_server(("127.0.0.1", self.port), backlog=4096)
        loop = asyncio.new_event_loop()
        server = loop.run_until_complete(loop.create_server(lambda: _ScrapeProtocol(self), sock=sock))
        thread = threading.Thread(target=loop.run_forever, name="synthetic-fleet", daemon=True)
        thread.start()
        self._server = (loop, server, thread)
        log.info("event=fleet_started nodes=%d gpus=%d port=%d", len(self.names), self.gpus, self.port)
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        loop, server, thread = self._server

        async def close() -> None:
            server.close()
            for transport in list(self.connections):
                transport.abort()
            while self.connections:  # each abort's connection_lost runs on a later turn of the loop
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
        self._server = None

    def sick(self) -> set[tuple[str, str]]:
        """(node, gpu) of the GPUs that carry precursors."""
        gpus = self.gpus // len(self.names)
        return {(name, str(gpu)) for index, name in enumerate(self.names) for gpu in range(gpus)
                if (index * gpus + gpu) % self.sick_every == 0}

    def scrape_config(self, interval: str) -> dict:
        """One scrape job with a target per node; ``node`` (and ``cluster``) are target labels, as in
        production."""
        identity = {"cluster": self.cluster} if self.cluster else {}
        return {
            "job_name": "gpuhealth-exporter",
            "scrape_interval": interval,
            "scrape_timeout": interval,
            "static_configs": [{"targets": [f"127.0.0.1:{self.port}"], "labels": {**identity, "node": name}}
                               for name in self.names],
            "relabel_configs": [{"source_labels": ["node"], "target_label": "__param_node"}],
        }
