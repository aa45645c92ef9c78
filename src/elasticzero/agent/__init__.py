"""elasticzero.agent."""
