"""The learner's kernel's side of grading: run an answer on a case (runner), guard it, send plain data (wire)."""

__all__ = []
