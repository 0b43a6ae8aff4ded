"""Grafana dashboards for gpuhealth, generated from code into committed, importable JSON.

The dashboards read only Prometheus data named in ``docs/contract.md``: exporter metrics, the rules'
recording rules and the webhook's metrics. Nothing here imports another component.
"""
