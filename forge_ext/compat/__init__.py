"""Small, tested fixes for version mismatches in the pinned stack (see shared FINDINGS)."""
