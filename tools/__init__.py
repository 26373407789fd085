"""Developer tools that ship with kiln: ``python -m kiln.tools.attack`` runs the attack suite."""
