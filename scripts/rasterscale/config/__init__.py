"""The workflow configuration: its schema, validation with defaults, and scene tables and globs."""
