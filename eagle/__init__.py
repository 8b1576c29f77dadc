"""EAGLE-style draft heads for speculative decoding of frozen HF causal LMs."""

__version__ = "0.1.0"
