"""Imports every built-in linear method so each registers itself."""

from tandem.engine.quant import float_methods, fp8, int4, int8, w8a8  # noqa: F401
