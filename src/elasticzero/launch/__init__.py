"""elasticzero.launch."""
