"""kiln.frontend: see DESIGN.md (built by a later issue)."""
