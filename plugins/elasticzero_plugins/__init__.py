"""Launcher backends shipped with elasticzero, one module each.

Each module defines one :class:`elasticzero.launch.backend.LauncherBackend` subclass, registered under the
entry-point group ``elasticzero.launchers`` (see pyproject.toml). A site adds its own backend (Flux, LSF, k8s)
by publishing a class under that group from its own package; core code never imports this package directly.
"""
