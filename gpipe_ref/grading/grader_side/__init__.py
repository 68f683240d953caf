"""The grader's side: start and end kernels (kernel, processes), grade a notebook, a class, and report."""

__all__ = []
