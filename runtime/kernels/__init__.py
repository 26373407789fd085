"""Kernel libraries of the runtime, one folder per device (``cpu/``; ``cuda/`` later)."""
