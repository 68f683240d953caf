"""The course's exercises: one module per notebook (``exNN_topic``), their shared helpers, and the catalogue."""

__all__ = []
