"""kiln's own version (the package), kept apart so every module can import it cheaply."""
__version__ = "0.1.0"
