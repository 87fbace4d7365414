"""The workflow's side of the package: what the rules and their jobs read and write."""
