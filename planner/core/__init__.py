"""The shared core every planner stands on: model specs, the GPU catalog, cluster and plan files,
profiles, the exact memory model and the runtime's units. Imports nothing else from `planner`.
"""
