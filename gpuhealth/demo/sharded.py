"""The closed loop with Prometheus sharded and a global tier (README "Scaling"), on loopback.

The single-tier stack's Slurm cluster, simulated-GPU exporters, Alertmanager and webhook, with the
metrics tier split as a large fleet runs it: N Prometheus shards, each scraping the nodes whose
``node`` label ``hashmod`` gives it and evaluating the shard rules, remote-write their ``gpuhealth:*``
records and ``ALERTS`` to VictoriaMetrics, where vmalert evaluates the global rules (lemon nodes,
fleet judgements) and notifies the same Alertmanager. Each shard's prometheus.yml comes from the
``gpuhealth_prometheus`` role's template and the global rules go where ``gpuhealth_global`` puts them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpuhealth.demo import deployment
from gpuhealth.demo.stack import PROMETHEUS_RULES_DIR, ClosedLoopStack, StackOptions, started
from gpuhealth.local.process import ProcessError, wait_until
from gpuhealth.local.prometheus import PrometheusAPI, PrometheusServer
from gpuhealth.local.victoria import VictoriaMetricsServer, VmalertServer

GLOBAL_RULES_DIR = deployment.role_defaults("gpuhealth_global")["gpuhealth_global_rules_dir"]
#: What a past failure of a node looks like in ALERTS: the alert of a GPU fallen off the bus.
PAST_FAILURE = {"alertname": "GPUHealthXidRebootNode", "alertstate": "firing", "action": "drain_reboot",
                "severity": "critical", "gpu": "0"}


class ShardedStack(ClosedLoopStack):
    """``shards`` Prometheus shards and the global tier in place of the one Prometheus."""

    rules_tier = "shard"

    def __init__(self, options: StackOptions | None = None, workdir: Path | None = None,
                 shards: int = 2) -> None:
        if shards < 2:
            raise ValueError("a sharded stack needs at least 2 shards")
        super().__init__(options, workdir)
        self.shard_count = shards
        self.shards: list[PrometheusServer] = []
        self.victoria: VictoriaMetricsServer | None = None
        self.vmalert: VmalertServer | None = None
        self.shard_of: dict[str, str] = {}  # node -> the shard that scrapes it, once every target is up

    @staticmethod
    def shard_name(index: int) -> str:
        """The shard's external label ``prometheus``, as the role's template sets it."""
        return f"shard-{index}"

    def _start_metrics(self, generated: Path, progress: Callable[[str], None]) -> None:
        progress("starting the global tier: VictoriaMetrics, and vmalert with the global rules "
                 "(lemon nodes, fleet judgements)")
        global_rules = self._install_rules(self._generate_rules("global"), GLOBAL_RULES_DIR)
        self.victoria = VictoriaMetricsServer(self.root / "victoria-metrics").start()
        self.vmalert = VmalertServer(self.root / "vmalert", global_rules, self.victoria,
                                     started(self.alertmanager).url,
                                     interval=self.options.evaluation_interval).start()
        progress(f"starting {self.shard_count} Prometheus shards with the shard rules, each scraping the "
                 "nodes hashmod gives it and remote-writing its records and alerts to VictoriaMetrics")
        self._install_rules(generated, PROMETHEUS_RULES_DIR)
        for index in range(self.shard_count):
            config = self._prometheus_config(
                gpuhealth_prometheus_shards=self.shard_count,
                gpuhealth_prometheus_shard_index=index,
                gpuhealth_prometheus_remote_write_url=self.victoria.remote_write_url,
                # the webhook is one target: one shard scrapes it, or its alerts would come twice
                gpuhealth_prometheus_webhook_target=f"127.0.0.1:{self.webhook_port}" if index == 0 else "")
            self.shards.append(PrometheusServer(self.root / f"prometheus-{self.shard_name(index)}",
                                                config).start())

    def stop(self) -> None:
        for proc in [self.vmalert, *self.shards, self.victoria]:
            if proc is not None:
                proc.stop()
        super().stop()

    # --- observing ---------------------------------------------------------------------------------

    @property
    def fleet_api(self) -> PrometheusAPI:
        """VictoriaMetrics: every shard's records and alerts, and the global tier's alerts."""
        return started(self.victoria).api

    def wait_targets_up(self, timeout: float = 60.0) -> None:
        """Every exporter up in exactly one shard; records which shard scrapes which node."""
        def placed() -> bool:
            found: dict[str, list[str]] = {}
            for index, shard in enumerate(self.shards):
                if not shard.running:
                    raise ProcessError(f"{shard.name} {self.shard_name(index)} exited:\n{shard.log_tail()}")
                for sample in shard.api.query('up{job="gpuhealth-exporter"} == 1'):
                    found.setdefault(sample["metric"]["node"], []).append(self.shard_name(index))
            if sorted(found) != sorted(self.nodes):
                return False
            doubled = {node: shards for node, shards in found.items() if len(shards) > 1}
            if doubled:
                raise ProcessError(f"nodes scraped by more than one shard: {doubled}")
            self.shard_of = {node: shards[0] for node, shards in found.items()}
            return True
        wait_until(placed, timeout, interval=0.5, what="every exporter scraped by one shard")

    def nodes_of(self, shard: str) -> list[str]:
        return [node for node in self.nodes if self.shard_of.get(node) == shard]

    def urls(self) -> dict[str, str]:
        urls = {f"Prometheus {self.shard_name(i)}": f"{shard.url}/alerts"
                for i, shard in enumerate(self.shards)}
        urls["VictoriaMetrics"] = f"{self.victoria.url}/vmui" if self.victoria else ""
        urls["vmalert"] = self.vmalert.url if self.vmalert else ""
        return {**urls, **{name: url for name, url in super().urls().items() if name != "Prometheus"}}

    # --- history -----------------------------------------------------------------------------------

    def import_past_failures(self, node: str, shard: str, starts: list[float], minutes: int = 5) -> None:
        """Write failures of ``node`` that began at ``starts`` (unix seconds, each lasting ``minutes``)
        into VictoriaMetrics as shard ``shard`` remote-wrote them: its ``ALERTS`` samples every 15 s
        with its external label. This is how the global tier holds a node's history from before a
        reshard moved it to another shard, which that shard never saw."""
        labels = ",".join(f'{key}="{value}"' for key, value in
                          {**PAST_FAILURE, "node": node, "prometheus": shard}.items())
        started(self.victoria).import_text(
            f"ALERTS{{{labels}}} 1 {int((start + offset) * 1000)}"
            for start in starts for offset in range(0, minutes * 60, 15))
