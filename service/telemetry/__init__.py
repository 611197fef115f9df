"""modeserve.service.telemetry."""
