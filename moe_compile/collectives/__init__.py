"""Compressors and all-to-all algorithms, as registries (issues: expert parallelism, compression)."""
