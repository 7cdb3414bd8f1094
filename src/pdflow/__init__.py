"""pdflow: a specified, model-checked protocol core for PD-disaggregated LLM serving."""

__version__ = "0.1.0"
