"""The spec's error type, in a module of its own: ``layouts`` raises it and ``spec`` builds on
``layouts``, so neither has to import the other back."""


class SpecError(ValueError):
    """An invalid :class:`~tvm_attention.spec.AttentionSpec`; the message names the offending field."""
