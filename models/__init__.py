"""GPUMix models: the torch decoders built from a contracts.specs.ModelSpec."""
