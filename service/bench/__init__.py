"""modeserve.service.bench."""
