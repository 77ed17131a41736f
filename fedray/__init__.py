"""fedray: a Ray-based simulator for federated learning and federated knowledge distillation."""

__version__ = "0.1.0"
