"""Starting runs on clusters: the world from whichever launcher started a process (`environment`),
host lists as schedulers write them (`hosts`), and job scripts for PBS and Slurm (`jobs`)."""

from .environment import LaunchError, World, adopt, detect

__all__ = ["LaunchError", "World", "adopt", "detect"]
