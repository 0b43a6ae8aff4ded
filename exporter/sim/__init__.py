"""Simulated NVML: the pynvml subset the exporter calls, driven by a scenario of timed faults."""
