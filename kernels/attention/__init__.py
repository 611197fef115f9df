"""modeserve.kernels.attention."""
