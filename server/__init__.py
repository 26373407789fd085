"""kiln.server: see DESIGN.md (built by a later issue)."""
