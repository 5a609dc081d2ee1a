"""Shoal: isolated, stateful code execution for LLM gateways."""

__version__ = "0.1.0"
