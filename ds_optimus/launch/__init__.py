"""Starting runs on clusters: the launcher's world (`environment`), host lists (`hosts`), PBS/Slurm scripts (`jobs`)."""

from .environment import LaunchError, World, adopt, detect

__all__ = ["LaunchError", "World", "adopt", "detect"]
