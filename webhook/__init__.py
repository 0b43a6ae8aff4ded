"""gpuhealth-webhook: turns Alertmanager notifications into safe, journaled cluster actions."""
