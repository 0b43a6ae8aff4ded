"""Cluster backends: the only code that acts on a scheduler or orchestrator."""
