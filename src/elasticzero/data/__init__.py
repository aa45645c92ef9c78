"""elasticzero.data."""
