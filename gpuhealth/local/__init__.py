"""Run real daemons (Prometheus, Alertmanager, Slurm) as local loopback processes.

Used by the demo, the detection evaluation, the benchmarks and the tests, so that every one of them
starts, waits for and tears down daemons the same way: no process is ever left behind.
"""
