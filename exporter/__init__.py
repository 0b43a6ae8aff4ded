"""gpuhealth node exporter: GPU health features from NVML, the kernel log and the host."""

__version__ = "0.1.0"
