"""Starting jobs: the ``fleetmpirun`` launcher, Slurm support and environment detection."""
