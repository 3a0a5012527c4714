"""Atlas and BubbleTea: pipelines across datacenters and prefill in their bubbles.
Imports `planner.core` and `planner.costmodel`.
"""
