"""Tensor parallelism: one engine over several devices, a process per device."""
