"""Plans at scale: pipeline stages over groups of nodes × uneven data parallelism × tensor parallelism (docs/models/scale.md)."""
