"""elasticzero.engine."""
