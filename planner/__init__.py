"""GPUMix planner: pure Python (no torch). Specs, cost models, ILP solvers, simulators, CLI."""
