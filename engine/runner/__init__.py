"""modeserve.engine.runner."""
