"""IPython.core, as far as ipywidgets' Output widget names it at import."""
