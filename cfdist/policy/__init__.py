"""When to checkpoint: pure decisions from measurements. No I/O, no collectives."""

from cfdist.policy.auto import Auto, AutoConfig
from cfdist.policy.base import Every, EveryEpoch, Policy, PolicyBase, PolicyContext, StepMeasurement, profile_key
from cfdist.policy.tuner import TunerConfig

__all__ = ["Auto", "AutoConfig", "Every", "EveryEpoch", "Policy", "PolicyBase", "PolicyContext", "StepMeasurement",
           "TunerConfig", "profile_key"]
