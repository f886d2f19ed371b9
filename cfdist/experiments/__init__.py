"""Preemption experiments: an entry point above :func:`cfdist.fit` (imports the cluster layer and Ray).

* :mod:`~cfdist.experiments.experiment`: the same job under the same failure schedule, once per
  checkpoint policy, measured and simulated side by side (``cfdist experiment``).
* :mod:`~cfdist.experiments.workload`: the small training job the experiment runs on every rank.

The pure parts (schedules, traces, simulator, metrics, calibration, report) live in
:mod:`cfdist.chaos`, which imports nothing from here, from :mod:`cfdist.cluster` or from
:mod:`cfdist.api`. Nothing is imported here eagerly (Ray is heavy).
"""
