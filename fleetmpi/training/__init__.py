"""What a training loop uses around the model, in the trainer's layer: data (``data``),
checkpoints (``checkpoint``, ``checkpoint_agreement``, ``hybrid_checkpoint``,
``serialization``), elastic resume (``elastic``), progress (``progress``), logged scalars
(``log_writer``) and the check that every rank built the same model (``model_agreement``).
"""
