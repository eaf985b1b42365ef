"""The training configuration, as pydantic models.

Every model forbids unknown keys, so a typo is an error with its dotted path.
Memory techniques are tagged unions (``{kind: ...}``) so an error points at the
chosen option. Cross-field rules live in validators whose messages say what to
change.

One module per section, each importing only ``base`` and the sections it names:

- ``base``: ``Strict``, the base model of every section
- ``model``: ``ModelConfig`` (``model``)
- ``data``: ``DataConfig``, ``SubsetConfig``, ``PrecomputeConfig``, ``T5Options``, ``LLMOptions``, ``TextEncodersConfig``, ``DreamBoothConfig``
  (``data``, ``precompute``, ``text_encoders``, ``dreambooth``)
- ``training``: ``TrainConfig``, ``FlowConfig``, ``FullConfig``, ``EMAConfig``, ``SaveConfig``,
  ``ValidationConfig``, ``ReportConfig`` (``train``, ``flow``, ``full``, ``ema``, ``save``, ``validation``,
  ``report``)
- ``lora``: ``LoraConfig`` (``lora``)
- ``memory``: the ``Weights*``, ``Opt*``, ``Act*``, ``Offload*`` and ``Engine*`` options, their tagged unions and
  ``MemoryConfig`` (``memory``)
- ``speed``: ``SpeedConfig`` (``speed``)
- ``root``: ``Config`` with its cross-section validators, and ``FamilyFacts``, what validation may be told of the
  model families

Import the names from here (``difftrain.config.schema``); the modules are its layout, not its interface.
"""

from __future__ import annotations

from .base import Strict
from .data import (
    DataConfig,
    DreamBoothConfig,
    LLMOptions,
    PrecomputeConfig,
    SubsetConfig,
    T5Options,
    TextEncodersConfig,
)
from .lora import LoraConfig
from .memory import (
    ActCheckpoint,
    Activations,
    ActNone,
    Engine,
    EngineAuto,
    EngineDDP,
    EngineDeepSpeed,
    EngineFSDP,
    EngineSingle,
    MemoryConfig,
    Offload,
    OffloadBlockSwap,
    OffloadNone,
    OptAdafactor,
    OptAdamW,
    OptAdamW4bit,
    OptAdamW8bit,
    OptCPUOffload,
    Optimizer,
    Weights,
    WeightsBF16,
    WeightsFP8,
    WeightsFP16,
    WeightsFP32,
    WeightsInt4,
    WeightsInt8,
    WeightsNF4,
)
from .model import ModelConfig
from .root import Config, FamilyFacts
from .speed import SpeedConfig
from .training import (
    EMAConfig,
    ExportFormat,
    FlowConfig,
    FullConfig,
    ReportConfig,
    ReportSink,
    SaveConfig,
    TrainConfig,
    ValidationConfig,
)

__all__ = [
    "ActCheckpoint",
    "ActNone",
    "Activations",
    "Config",
    "DataConfig",
    "DreamBoothConfig",
    "EMAConfig",
    "Engine",
    "EngineAuto",
    "EngineDDP",
    "EngineDeepSpeed",
    "EngineFSDP",
    "EngineSingle",
    "ExportFormat",
    "FamilyFacts",
    "FlowConfig",
    "FullConfig",
    "LLMOptions",
    "LoraConfig",
    "MemoryConfig",
    "ModelConfig",
    "Offload",
    "OffloadBlockSwap",
    "OffloadNone",
    "OptAdafactor",
    "OptAdamW",
    "OptAdamW4bit",
    "OptAdamW8bit",
    "OptCPUOffload",
    "Optimizer",
    "PrecomputeConfig",
    "ReportConfig",
    "ReportSink",
    "SaveConfig",
    "SpeedConfig",
    "Strict",
    "SubsetConfig",
    "T5Options",
    "TextEncodersConfig",
    "TrainConfig",
    "ValidationConfig",
    "Weights",
    "WeightsBF16",
    "WeightsFP8",
    "WeightsFP16",
    "WeightsFP32",
    "WeightsInt4",
    "WeightsInt8",
    "WeightsNF4",
]
