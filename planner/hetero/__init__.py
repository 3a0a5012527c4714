"""Cephalo's planner: an uneven data-parallel plan over a heterogeneous cluster (ILP) and its
baselines. Imports `planner.core` and `planner.costmodel`.
"""
