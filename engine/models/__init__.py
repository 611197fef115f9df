"""modeserve.engine.models."""
