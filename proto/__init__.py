"""modeserve.proto."""
