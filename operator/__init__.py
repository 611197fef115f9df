"""modeserve.operator."""
