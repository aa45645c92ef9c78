"""elasticzero.checkpoint."""
