"""modeserve.service.router."""
