"""Generated stubs of modeserve.v1 (see proto/generate_stubs.py)."""
