"""What a run stands on, below the pipelines: ``distributed`` (process groups, the launcher, per-rank slices),
``locks`` (one writer at a time for a run folder, a cache or a sweep folder) and ``hub`` (Hugging Face Hub model
ids: parsed, found in the local cache or fetched, only the parts a family loads)."""
