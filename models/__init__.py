"""GPUMix models: the torch decoders built from a planner.core.specs.ModelSpec."""
