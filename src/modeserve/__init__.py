"""modeserve: an LLM inference microservice organised by forward mode."""

__version__ = "0.1.0"
