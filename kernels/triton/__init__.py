"""The project's own Triton kernels (GPU; Triton's CPU interpreter runs them in tests)."""
