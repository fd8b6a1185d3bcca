"""The parts of ``benchmarks/train_throughput.py``: its models, the precisions they train in,
FLOP and peak arithmetic, the measurements of one training step, and the table's rows."""
