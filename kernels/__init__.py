"""modeserve.kernels."""
