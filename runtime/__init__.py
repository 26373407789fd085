"""kiln.runtime: see DESIGN.md (built by a later issue)."""
