"""Cluster view: the bootstrap registry and the prefill/decode rank topology."""
