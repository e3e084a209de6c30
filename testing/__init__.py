"""Test support, never imported by the product: stub workers that speak the worker protocol
without a model, and random-weight models in real shapes."""
