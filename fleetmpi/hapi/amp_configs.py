"""``Model.prepare(amp_configs=...)``: Paddle's forms, checked as Paddle checks them.

``None`` or ``"O0"``: float32; ``"O1"`` / ``"O2"``; or a dict with ``level`` (default
``"O1"``), the operator lists of ``auto_cast`` (``custom_white_list``,
``custom_black_list``), and ``GradScaler``'s arguments (``init_loss_scaling``,
``incr_ratio``, ``decr_ratio``, ``incr_every_n_steps``, ``decr_every_n_nan_or_inf``,
``use_dynamic_loss_scaling``). ``dtype`` (``"float16"`` or ``"bfloat16"``), which
``auto_cast`` takes, is taken too.
"""
LEVELS = ("O0", "O1", "O2")
CAST_KEYS = ("custom_white_list", "custom_black_list", "dtype")
SCALER_KEYS = ("init_loss_scaling", "incr_ratio", "decr_ratio", "incr_every_n_steps",
               "decr_every_n_nan_or_inf", "use_dynamic_loss_scaling")


class AmpConfigs:
    """``level``, ``cast`` (``auto_cast``'s keyword arguments but ``enable`` and ``level``)
    and ``scaler`` (``GradScaler``'s) of one ``amp_configs``."""

    def __init__(self, amp_configs=None):
        self.cast, self.scaler = {}, {}
        if not amp_configs:
            self.level = "O0"
            return
        if isinstance(amp_configs, str):
            amp_configs = {"level": amp_configs}
        if not isinstance(amp_configs, dict):
            raise TypeError(f"amp_configs must be None, 'O0', 'O1', 'O2' or a dict, not "
                            f"{type(amp_configs).__name__}")
        self.level = amp_configs.get("level", "O1")
        if self.level not in LEVELS:
            raise ValueError(f"amp_configs level {self.level!r}; allowed: 'O0', 'O1', 'O2'")
        if "use_pure_fp16" in amp_configs:
            raise ValueError("amp_configs 'use_pure_fp16' is not an argument here: level 'O2' "
                             "is pure float16 training, as in Paddle")
        if "use_fp16_guard" in amp_configs:
            raise ValueError("amp_configs 'use_fp16_guard' is Paddle's static-graph argument; "
                             "fleetmpi trains in dygraph, where Paddle refuses it too")
        unknown = sorted(set(amp_configs) - {"level"} - set(CAST_KEYS) - set(SCALER_KEYS))
        if unknown:
            raise ValueError(f"amp_configs keys {unknown} are not recognised; allowed besides "
                             f"'level': {', '.join(CAST_KEYS + SCALER_KEYS)}")
        self.cast = {k: amp_configs[k] for k in CAST_KEYS if k in amp_configs}
        self.scaler = {k: amp_configs[k] for k in SCALER_KEYS if k in amp_configs}

    @property
    def enabled(self):
        return self.level != "O0"
