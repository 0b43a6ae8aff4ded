"""What a PromQL form costs on a fleet, side by side: the choices behind the generated rules.

Scrapes the synthetic fleet of ``bench/rules.py`` with a real Prometheus (no rules), then stops
scraping and runs pairs of equivalent expressions as instant queries at one instant, printing the
Prometheus CPU seconds each costs. On a large fleet a rule's cost is mostly the series it reads,
so a rate over a short window (one read) beats two instant lookups (``x - x offset w``), and a
per-GPU total beats per-link counters. The fabric forms price what the fabric group reads of every
NIC port: its link losses since the previous evaluation, its state, rate and inventory.

    .venv/bin/python bench/promql_reads.py                     # 512 nodes, 6 minutes of data
    .venv/bin/python bench/promql_reads.py --nodes 128 --minutes 5.5
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

from gpuhealth.local.prometheus import PrometheusServer
from gpuhealth.local.synthetic_fleet import SyntheticFleet

NVLINK_TOTAL = "gpuhealth_gpu_nvlink_errors_all_links_total"
NVLINK_LINKS = "gpuhealth_gpu_nvlink_errors_total"
INFO = "group by (node, gpu, model) (gpuhealth_gpu_info)"
UTIL = "max by (node, gpu) (gpuhealth_gpu_utilization_ratio)"
PORT = "cluster, node, device, port"
DOWNED = "gpuhealth_nic_port_link_downed_total"
DOWNED_BEFORE = f"{DOWNED} offset 1m"
UP = "gpuhealth_nic_port_up"
RATE = "gpuhealth_nic_port_rate_bytes_per_second"
EXPECTED = "gpuhealth_nic_port_expected_rate_bytes_per_second"

#: (what, expression): each block compares forms that give the same answer.
FORMS = [
    ("NVLink rate, per-GPU total: rate over 5m", f"sum by (node, gpu) (rate({NVLINK_TOTAL}[5m]))"),
    ("NVLink rate, per-GPU total: two lookups", f"(sum by (node, gpu) ({NVLINK_TOTAL}) - "
                                                f"sum by (node, gpu) ({NVLINK_TOTAL} offset 5m)) / 300"),
    ("NVLink rate, worst link: rate over 5m",
     f"max by (node, gpu) (sum by (node, gpu, link) (rate({NVLINK_LINKS}[5m])))"),
    ("NVLink rate, worst link: two lookups",
     f"max by (node, gpu) ((sum by (node, gpu, link) ({NVLINK_LINKS}) - "
     f"sum by (node, gpu, link) ({NVLINK_LINKS} offset 5m)) / 300)"),
    ("peer class: utilisation read once",
     f'label_replace({INFO} * on (node, gpu) group_left () ({UTIL} >= bool 0.5) > 0, "load", "busy", "", "")'
     f' or on (node, gpu) label_replace({INFO}, "load", "idle", "", "")'),
    ("peer class: and / unless, utilisation read twice",
     f'label_replace({INFO} and on (node, gpu) ({UTIL} >= 0.5), "load", "busy", "", "") or '
     f'label_replace({INFO} unless on (node, gpu) ({UTIL} >= 0.5), "load", "idle", "", "")'),
    ("port link losses in 1m: grew, then arithmetic", f"({DOWNED} > {DOWNED_BEFORE}) - {DOWNED_BEFORE}"),
    ("port link losses in 1m: arithmetic, then > 0", f"({DOWNED} - {DOWNED_BEFORE}) > 0"),
    ("port link losses in 1m: with resets, summed",
     f"sum by ({PORT}) (({DOWNED} > {DOWNED_BEFORE}) - {DOWNED_BEFORE} or ({DOWNED} < {DOWNED_BEFORE}) > 0)"),
    ("ports down: == 0", f"group by ({PORT}) ({UP} == 0)"),
    ("port rate below expected: and up == 1", f"({RATE} < {EXPECTED}) and on ({PORT}) ({UP} == 1)"),
    ("port rate below expected: unless up != 1", f"({RATE} < {EXPECTED}) unless on ({PORT}) ({UP} != 1)"),
    ("port's switch: group by", f"group by ({PORT}, switch) (gpuhealth_nic_port_info)"),
    ("ports of each switch: count by", 'count by (cluster, switch) (gpuhealth_nic_port_info{switch!=""})'),
]


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpuhealth-bench-promql-") as tmp:
        fleet = SyntheticFleet(args.nodes, nvlinks=args.nvlinks, nics=args.nics).start()
        config = {"global": {"scrape_interval": "15s"}, "scrape_configs": [fleet.scrape_config("15s")]}
        prometheus = PrometheusServer(Path(tmp) / "prometheus", config)
        try:
            prometheus.start(timeout=120)
            print(f"{args.nodes} nodes x 8 GPUs, {args.nvlinks} NVLinks, {args.nics} NIC ports; "
                  f"collecting {args.minutes} min",
                  flush=True)
            time.sleep(args.minutes * 60)
            now = time.time() - 1   # before scraping stops: no staleness markers yet
            prometheus.stop_scraping()
            print(f"\n{'form':<48}{'CPU s per query':>16}{'series':>9}")
            for what, expr in FORMS:
                series = len(prometheus.api.query(expr, time=now))
                before = prometheus.cpu_seconds()
                for _ in range(args.repeats):
                    prometheus.api.query(expr, time=now)
                print(f"{what:<48}{(prometheus.cpu_seconds() - before) / args.repeats:>16.3f}{series:>9}")
            return 0
        finally:
            prometheus.stop()
            fleet.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=512, help="synthetic nodes (default 512)")
    parser.add_argument("--nvlinks", type=int, default=4, help="NVLinks per GPU exposed (default 4)")
    parser.add_argument("--nics", type=int, default=8, help="InfiniBand ports per node (default 8)")
    parser.add_argument("--minutes", type=float, default=6, help="minutes of data, > 5 for the offsets")
    parser.add_argument("--repeats", type=int, default=10, help="queries per form (default 10)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
