"""elasticzero.config."""
