"""``gpuhealth demo``: the closed loop (simulated GPUs -> Prometheus -> Alertmanager -> webhook -> Slurm)."""

from gpuhealth.demo.cli import register

__all__ = ["register"]
