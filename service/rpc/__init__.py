"""modeserve.service.rpc."""
