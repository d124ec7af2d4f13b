"""The defaults of transformers' quantized cache layer, as plain numbers (no torch).

These are transformers' own: the defaults of ``transformers.cache_utils.QuantizedLayer.__init__``
(``q_group_size``, ``residual_length``, ``axis_key``, ``axis_value``), kept here so that the
registry's table (:mod:`kvlib.caches.entries`) needs no transformers.
``tests/test_cache_registry.py`` reads the signature and checks that they still agree, so a
transformers upgrade that changes them fails there.
"""

from __future__ import annotations

__all__ = ["AXIS_KEY", "AXIS_VALUE", "Q_GROUP_SIZE", "RESIDUAL_LENGTH"]

#: Values per scale and zero point (``QuantizedLayer``'s ``q_group_size``).
Q_GROUP_SIZE = 64
#: Newest tokens kept in full precision (``QuantizedLayer``'s ``residual_length``).
RESIDUAL_LENGTH = 128
#: The axis the keys are grouped along (``QuantizedLayer``'s ``axis_key``).
AXIS_KEY = 0
#: The axis the values are grouped along (``QuantizedLayer``'s ``axis_value``).
AXIS_VALUE = 0
