"""Data stage: manifests, synthetic mixtures, bucketing to Wan 2.1 shapes, latent datasets."""
