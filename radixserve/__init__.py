"""radixserve: an LLM inference server that reuses prompt KV across requests."""
__version__ = "0.1.0"
