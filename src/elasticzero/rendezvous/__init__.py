"""elasticzero.rendezvous."""
