"""When to checkpoint: pure decisions from measurements. No I/O, no collectives."""

from cfdist.policy.base import Every, EveryEpoch, Policy, StepMeasurement

__all__ = ["Every", "EveryEpoch", "Policy", "StepMeasurement"]
