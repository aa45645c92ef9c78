"""elasticzero.config: the engine's omegaconf schema, strict loading (YAML/JSON/hjson), DeepSpeed ``ds_config``
mapping, and a builder of the engine pieces. Names resolve lazily (PEP 562): importing the package loads no torch.
"""

from __future__ import annotations

from elasticzero._lazy import lazy_getattr

_LAZY = {
    "EngineConfig": "elasticzero.config.schema",
    "ZeroConfig": "elasticzero.config.schema",
    "PrecisionConfig": "elasticzero.config.schema",
    "LossScaleConfig": "elasticzero.config.schema",
    "OptimizerConfig": "elasticzero.config.schema",
    "TimersConfig": "elasticzero.config.schema",
    "Precision": "elasticzero.config.schema",
    "load_config": "elasticzero.config.load",
    "load_deepspeed_config": "elasticzero.config.load",
    "config_from_dict": "elasticzero.config.load",
    "read_file": "elasticzero.config.load",
    "validate": "elasticzero.config.load",
    "DeepSpeedReport": "elasticzero.config.deepspeed",
    "map_deepspeed": "elasticzero.config.deepspeed",
    "build_pieces": "elasticzero.config.build",
    "build_loss_scaler": "elasticzero.config.build",
    "EnginePieces": "elasticzero.config.build",
    "ElasticityConfig": "elasticzero.config.schema",
    "ActivationCheckpointingConfig": "elasticzero.config.schema",
    "BatchPlan": "elasticzero.config.elastic",
    "ElasticBatch": "elasticzero.config.elastic",
    "elastic_batch": "elasticzero.config.elastic",
    "batch_plan": "elasticzero.config.elastic",
    "check_world_range": "elasticzero.config.elastic",
    "load_elastic_batch": "elasticzero.config.load",
    "SchedulerConfig": "elasticzero.config.schema",
    "AutoValues": "elasticzero.config.auto",
    "fill_auto": "elasticzero.config.auto",
    "fill_native": "elasticzero.config.auto",
    "check_elastic_config": "elasticzero.config.load",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
