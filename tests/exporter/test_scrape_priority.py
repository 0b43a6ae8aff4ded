"""Scrapes before sampling: sampling threads give way while a request is answered, boundedly."""

from __future__ import annotations

import gzip
import socket
import threading
import time

from gpuhealth.exporter.collector import Context, load_collectors
from gpuhealth.exporter.metrics import Families, Renderer
from gpuhealth.exporter.nvml_reader import NvmlReader
from gpuhealth.exporter.sampler import Sampler
from gpuhealth.exporter.scrape_priority import ScrapePriority
from gpuhealth.exporter.sim.nvml import SimulatedNvml
from gpuhealth.exporter.sim.scenario import load_scenario
from gpuhealth.exporter.web import make_server


def _poll(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _yield_on_a_thread(priority: ScrapePriority) -> threading.Thread:
    thread = threading.Thread(target=priority.yield_to_scrape, daemon=True)
    thread.start()
    return thread


def test_sampling_waits_while_a_request_is_answered_and_goes_on_once_it_is() -> None:
    priority = ScrapePriority(hold=60, budget=60)
    priority.yield_to_scrape()  # nothing served: no wait at all
    assert priority.given_way == 0
    priority.begin()
    assert priority.answering
    sampling = _yield_on_a_thread(priority)
    sampling.join(0.2)
    assert sampling.is_alive()  # giving way
    priority.end()
    assert _poll(lambda: not sampling.is_alive())
    assert not priority.answering and priority.given_way > 0


def test_a_wait_ends_at_the_hold_and_a_run_gives_way_for_its_budget_at_most() -> None:
    held = ScrapePriority(hold=0.05, budget=60)
    held.begin()  # never ended: a connection that sends nothing, or was lost
    sampling = _yield_on_a_thread(held)
    assert _poll(lambda: not sampling.is_alive())
    waited = held.given_way
    assert 0 < waited < 10
    held.yield_to_scrape()  # the hold is over: sampling goes on at once, without waiting again
    assert held.given_way == waited

    flooded = ScrapePriority(hold=60, budget=0.05)
    flooded.begin()
    flooded.yield_to_scrape()  # waits out the run's budget
    spent = flooded.given_way
    assert spent >= 0.05
    flooded.begin()  # another connection in the same run: the budget is gone
    flooded.yield_to_scrape()
    assert flooded.given_way == spent
    flooded.new_run()
    assert flooded.given_way == 0


def test_the_server_gives_priority_from_the_accept_to_the_written_answer() -> None:
    host = load_collectors()["host"].factory(Context())
    sampler = Sampler({"host": host})
    sampler.sample_once()
    server = make_server("127.0.0.1", 0, sampler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert server.priority is sampler.priority
        with socket.create_connection(server.server_address[:2]) as sock:
            assert _poll(lambda: sampler.priority.answering)  # accepted, nothing sent yet
            sock.sendall(b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(1 << 16):
                answer += chunk
        assert not sampler.priority.answering
        # the body is the snapshot's own pre-compressed bytes: nothing compressed per scrape
        assert answer.partition(b"\r\n\r\n")[2] == sampler.snapshot.gzipped
        assert gzip.decompress(sampler.snapshot.gzipped) == sampler.exposition
    finally:
        server.shutdown()
        server.server_close()


def test_sampling_offers_to_give_way_before_each_nvml_query_and_each_family(tmp_path) -> None:
    pauses: list[str] = []
    nvml = SimulatedNvml(load_scenario(None), tmp_path / "kmsg")
    nvml.nvmlInit()
    queries = []
    depth = [0]

    def counted(name: str):
        real = getattr(nvml, name)

        def call(*args, **kwargs):
            if not depth[0]:  # the exporter's query, not one the simulator makes of itself
                queries.append(name)
            depth[0] += 1
            try:
                return real(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for name in [n for n in dir(nvml) if n.startswith("nvmlDevice")]:
        setattr(nvml, name, counted(name))
    NvmlReader(nvml, lambda: pauses.append("nvml")).read(0, full=True)
    assert queries and pauses.count("nvml") == len(queries)

    families = Families()
    for name in ("gpuhealth_nvml_up", "gpuhealth_nvml_stalled", "gpuhealth_gpus_expected"):
        families.add(name, 1)
    Renderer(lambda: pauses.append("family")).render(families)
    assert pauses.count("family") == 3
