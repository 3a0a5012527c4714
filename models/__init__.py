"""GPUMix models: the torch decoders built from a planner.specs.ModelSpec."""
