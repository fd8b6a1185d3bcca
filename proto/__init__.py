"""The strategy schema: ``distributed_strategy.proto`` and ``distributed_strategy_pb2``, generated from it."""
