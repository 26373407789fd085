"""kiln.serializer: see DESIGN.md (built by a later issue)."""
