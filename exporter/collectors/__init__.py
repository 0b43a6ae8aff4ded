"""One module per collector; each registers itself with ``gpuhealth.exporter.collector.register``."""
