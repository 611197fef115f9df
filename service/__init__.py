"""modeserve.service."""
