"""PNG previews of the dashboards, drawn from a real Prometheus (``gpuhealth dashboards preview``).

A development tool, kept out of the deployable ``dashboards`` package: it runs the evaluation's
simulated fleet and a real webhook in local processes, and draws with matplotlib.
"""
