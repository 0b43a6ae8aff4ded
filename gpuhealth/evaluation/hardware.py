"""Figures of the simulated GPUs and hosts (H100 SXM nodes), read by the signals and the events."""

SLOWDOWN_C, SHUTDOWN_C = 87.0, 92.0
POWER_LIMIT_W, IDLE_POWER_W = 700.0, 70.0
SM_CLOCK_MAX_HZ, SM_CLOCK_IDLE_HZ = 1980e6, 345e6
MEMORY_TOTAL_BYTES = 80 * 1024**3
HOST_MEMORY_BYTES = 2 * 1024**4
HOST_CPUS = 96
