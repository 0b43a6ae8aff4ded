"""gpuhealth tooling: the ``gpuhealth`` command (rules, dashboards, eval, demo) and local-stack helpers.

The deployable components live beside this package (``exporter/``, ``rules/``, ``webhook/``,
``dashboards/``) and are installed as ``gpuhealth.<component>``; they share metric and label
names, never code.
"""

__version__ = "0.1.0"
