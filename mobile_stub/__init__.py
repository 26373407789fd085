"""kiln.mobile_stub: see DESIGN.md (built by a later issue)."""
