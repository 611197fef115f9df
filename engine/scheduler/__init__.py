"""modeserve.engine.scheduler."""
