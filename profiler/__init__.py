"""GPUMix profiler: device inventory, micro-benchmarks, model tracing, step profiles (torch)."""
