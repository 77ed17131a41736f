"""Differential privacy of what the clients send (``privacy.*``; docs/privacy.md): the clip and local noise as channel
stages, central noise as the aggregation hook's rule (:mod:`fedray.privacy.stages`), and the accountant
(:mod:`fedray.privacy.accounting`, Google's dp-accounting). Knows no method and no Ray."""
