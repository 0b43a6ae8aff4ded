"""Detection-quality benchmark: a simulated fleet with ground-truth failures, evaluated by Prometheus."""
