"""Prices: a small YAML file of instance types ($/hour on-demand and spot) and storage ($/GB).

Format (``cfdist/planner/prices-example.yaml`` is a dated example, not a quote)::

    currency: USD
    instances:
      gpu-8x-a100: {on_demand_per_hour: 32.00, spot_per_hour: 12.80}
    storage: {shared_per_gb_month: 0.023, egress_per_gb: 0.0}

Unknown keys, missing or negative prices and a missing instance type are errors that name the
file, the key and the fix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources

EXAMPLE = "prices-example.yaml"


def example_prices_path() -> str:
    """Path of the example price file shipped with cfdist (dated, an example only)."""
    return str(resources.files("cfdist.planner") / EXAMPLE)


@dataclass(frozen=True, kw_only=True)
class InstancePrice:
    """What one node of an instance type costs."""

    name: str
    """Instance type name, as in the file."""
    on_demand_per_hour: float
    """Dollars per node-hour, on-demand."""
    spot_per_hour: float
    """Dollars per node-hour, spot (preemptible)."""


@dataclass(frozen=True, kw_only=True)
class Prices:
    """A price file's contents."""

    instances: dict[str, InstancePrice] = field(default_factory=dict)
    """Instance types by name."""
    shared_per_gb_month: float = 0.0
    """Shared storage, dollars per GB-month (GB = 1e9 bytes; a month = 730 hours)."""
    egress_per_gb: float = 0.0
    """Reading checkpoints back from shared storage, dollars per GB."""
    currency: str = "USD"
    """Label of the amounts."""
    source: str = "<prices>"
    """Where these came from (for messages)."""

    def instance(self, name: str | None) -> InstancePrice:
        """The instance type ``name``; None: the only one in the file."""
        if name is None:
            if len(self.instances) == 1:
                return next(iter(self.instances.values()))
            raise ValueError(f"{self.source} lists {len(self.instances)} instance types "
                             f"({', '.join(sorted(self.instances))}); choose one with --instance NAME")
        if name not in self.instances:
            raise ValueError(f"{self.source} has no instance type {name!r}; it has {', '.join(sorted(self.instances))} "
                             f"(add it to the file or pick one of those)")
        return self.instances[name]


_TOP = {"currency", "instances", "storage"}
_INSTANCE = {"on_demand_per_hour", "spot_per_hour"}
_STORAGE = {"shared_per_gb_month", "egress_per_gb"}


def _unknown(where: str, got: dict, allowed: set[str]) -> None:
    extra = sorted(set(got) - allowed)
    if extra:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, extra))}; the keys are {', '.join(sorted(allowed))}")


def _price(where: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {key} must be a number >= 0 (dollars), got {value!r}")
    return float(value)


def parse_prices(data, *, source: str = "<prices>") -> Prices:
    """:class:`Prices` from the parsed YAML mapping ``data``; ValueError naming what is wrong."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with 'instances' (and optionally 'storage', 'currency'), "
                         f"got {type(data).__name__}; see {EXAMPLE}")
    _unknown(source, data, _TOP)
    raw = data.get("instances")
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{source}: 'instances' must map instance type names to "
                         f"{{on_demand_per_hour: ..., spot_per_hour: ...}}; got {raw!r}")
    instances = {}
    for name, spec in raw.items():
        where = f"{source}: instances.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{where} must be a mapping {{on_demand_per_hour: ..., spot_per_hour: ...}}, got {spec!r}")
        _unknown(where, spec, _INSTANCE)
        missing = sorted(_INSTANCE - set(spec))
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)} (dollars per node-hour)")
        instances[str(name)] = InstancePrice(name=str(name), **{k: _price(where, k, spec[k]) for k in _INSTANCE})
    storage = data.get("storage") or {}
    if not isinstance(storage, dict):
        raise ValueError(f"{source}: 'storage' must be a mapping of {', '.join(sorted(_STORAGE))}, got {storage!r}")
    _unknown(f"{source}: storage", storage, _STORAGE)
    currency = data.get("currency", "USD")
    if not isinstance(currency, str) or not currency:
        raise ValueError(f"{source}: currency must be a name such as USD, got {currency!r}")
    return Prices(instances=instances, currency=currency, source=source,
                  **{k: _price(f"{source}: storage", k, storage[k]) for k in _STORAGE if k in storage})


def load_prices(path: str | None = None) -> Prices:
    """The price file at ``path`` (None: the shipped example)."""
    import yaml

    path = path or example_prices_path()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    return parse_prices(data, source=path)
