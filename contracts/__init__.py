"""GPUMix's shared contracts, torch-free: model specs, the GPU catalog, cluster, plan and job files,
the runtime's units, constants, paths, JSON I/O and the CLI framework. Every other package builds on
this one; it imports none of them (docs/ARCHITECTURE.md, "Layers").
"""
