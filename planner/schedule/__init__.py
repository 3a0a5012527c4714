"""Frenzy's scheduler and its baselines: resource options per job, the event simulator, traces.
Imports `planner.core`, `planner.costmodel` and `planner.hetero`.
"""
