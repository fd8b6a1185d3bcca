"""The training strategies of DistributedStrategy: one class per strategy, and their composition."""
